"""The models: the drafter kinds, the EAGLE-3 and DFlash drafters, aux layers, the target's loading and the
compute precision."""
