"""One module per workflow stage (a CLI command and its rule). A stage imports core and back-ends,
never another stage."""
