"""The plugin system: the hooks a plugin implements (``hookspecs``), the specs it returns
(``specs``), the structural contract of a model (``protocols``), the registry that collects
them (``registry``), the core's own registrations (``builtins``), and the programmatic
dependent launch switch the kernel plugins share (``pdl``)."""
