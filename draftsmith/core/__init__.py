"""What the stages share; imports no stage. One sub-package per concept, each importing only those below
it (pyproject.toml's import contract; `a | b`: neither imports the other; docs/concepts.md says what each
holds):

    workflow  >  export | planning  >  training | evaluation  >  model  >  data  >  config  >  io
"""
