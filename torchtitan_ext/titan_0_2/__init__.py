"""The adapter for torchtitan 0.2.2 (TOML jobs): its entry is ``torchtitan_ext.register``,
named by ``[experimental] custom_import`` (and imported by ``torchtitan_ext.train``)."""
