"""One module per model family; each defines `SPEC_ARGS` for the registry and never imports another family."""
