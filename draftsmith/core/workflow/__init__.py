"""What the Snakefile runs at parse time: the start-up checks of the whole configuration against its
inputs (startup.py) and the builders of the rules' arguments (rule_args.py). Torch-free."""
