"""RRFP in torchtitan, for torchtitan 0.2.2 (TOML jobs) and 0.3 (config functions).

The entry points users name, at this level:

* ``torchtitan_ext.train``: ``torchrun ... -m torchtitan_ext.train`` on either version;
* ``torchtitan_ext.register`` and ``torchtitan_ext.config``: what a 0.2.2 TOML names
  (``[experimental] custom_import``, ``[job] custom_config_module``);
* ``torchtitan_ext.config_registry``: the 0.3 config functions (``--module
  torchtitan_ext --config <function>``).

``config`` holds the RRFP settings both versions read. The rest lives in three folders:
``common`` (shared by both versions), ``titan_0_2`` and ``titan_0_3`` (each version's
adapter). ``common.version`` says which adapter applies; importing this package never
fails.
"""
