"""Evaluation: the methods measured, speculative decoding, the cost model, the serving policy, projections,
statistics, the gate's verdict, its report, and the engine runs cached."""
