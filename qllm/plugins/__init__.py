"""The plugin system: the hooks a plugin implements (``hookspecs``), the specs it returns
(``specs``), the structural contract of a model (``protocols``), the registry that collects
them (``registry``) and the core's own registrations (``builtins``)."""
