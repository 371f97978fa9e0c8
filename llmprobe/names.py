"""The vocabularies every layer shares (layer 0: no imports): analysis names, protocols, scoring modes and the
embedding modes of the synthetic models. One tuple each; every check and default reads them from here."""

ANALYSES = ("lre", "ridge", "superposition")     # what ``--analyses`` can name
PROTOCOLS = ("strict", "lre")                    # strict: zero-shot prompt, exact first token; lre: the reference's
FIRST_TOKEN = "first_token"                      # an object scored by its first token
SEQUENCE = "sequence"                            # ... or by the full-sequence log-probability
SCORING_MODES = (FIRST_TOKEN, SEQUENCE)
CONTROL_MODES = ("trainable", "frozen")          # subject embeddings of the matched synthetic models
