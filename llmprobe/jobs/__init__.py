"""Jobs: the stage protocol, probe, the main job (run), the controls worker, rerun and the plan (layer 5)."""
