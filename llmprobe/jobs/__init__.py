"""Jobs: the stage protocol, probe, the main job (run), the controls worker and rerun (layer 5)."""
