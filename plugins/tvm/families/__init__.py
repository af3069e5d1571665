"""The networks of the built-in model families, one module per family.

Each module holds the `tvm.relax.frontend.nn` model the TVM executor builds
for that family, assembled from the shared parts in `decoder.py` and
`layers.py`. The families themselves (architectures, converter quirks) are
declared, without importing TVM, in `lockgate.plugins.tvm.BUILTIN_FAMILIES`.
"""
