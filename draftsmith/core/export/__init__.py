"""What is exported: the drafter's formats, one per engine (formats/), and the model card."""
