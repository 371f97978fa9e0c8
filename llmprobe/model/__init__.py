"""Places in a model and how to reach them: adapters, loading, capture, batching, subjects, known facts,
scoring, LRE Jacobians and the random-init control (layer 2)."""
