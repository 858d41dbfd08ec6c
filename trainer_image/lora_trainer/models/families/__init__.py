"""One module per model family; each defines `SPEC_ARGS` (build, weight table, LoRA targets) for the
registry, which adds the name, detection keys and target regex. Families never import each other."""
