"""Reports: schema (read/validate), claims (verdicts), figures, render (HTML/MD/CSV), notebook (layer 4)."""
