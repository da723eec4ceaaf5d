"""What the stages share: the drafter, its layers, the data files, decoding, statistics, cost and
memory models, settings and the target's loading. Imports no stage."""
