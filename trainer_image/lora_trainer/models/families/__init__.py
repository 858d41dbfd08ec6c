"""One folder per model family (docs/dev/adding-a-family.md): `<name>/__init__.py` declares `FAMILY`
(a FamilySpec; imports no JAX) and `<name>/model.py` builds the Tunix model, imported at the first
build. `common` holds the model code's shared helpers, `tables` the declarations'. The registry,
`config.Family`, the tiny test models and the adapter tests read the folders; families never import
each other."""
