"""The adapter for torchtitan 0.3 (config functions): its entry is
``torchtitan_ext.config_registry``, which ``--module torchtitan_ext`` loads."""
