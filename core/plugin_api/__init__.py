"""The plugin API: the hookspecs, the typed request the hooks receive, the
plugin manager, and the pipeline that calls the hooks in order."""
