"""The decision core: what a step means and which ready action runs.

The hint and its lowering pass (``plan``), the limits, the arbiter, the policies, the
duration history and the one pick -> launch -> complete loop. Torch enters only through
the schedule IR (``_Action``) and torch's schedule classes read as hints; nothing here
talks to another process, so the simulator runs this code as the runtime does.
"""
