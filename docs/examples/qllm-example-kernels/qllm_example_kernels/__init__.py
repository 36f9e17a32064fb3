"""The plugin guide's example kernel plugin (``docs/plugins.md``)."""
