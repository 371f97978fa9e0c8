"""The vocabularies every layer shares (layer 0: no imports): analysis names, protocols, scoring modes and the
embedding modes of the synthetic models (what each freezes, and the subsets each experiment runs). One constant
each; every check and default reads them from here."""

ANALYSES = ("lre", "ridge", "superposition", "crosspatch", "selector", "multihop")   # what ``--analyses`` can name
PROTOCOLS = ("strict", "lre")                    # strict: zero-shot prompt, exact first token; lre: the reference's
LRE_SELECTIONS = ("validation", "as-published")  # protocol lre: where beta, edit rank and layer are chosen
FIRST_TOKEN = "first_token"                      # an object scored by its first token
SEQUENCE = "sequence"                            # ... or by the full-sequence log-probability
SCORING_MODES = (FIRST_TOKEN, SEQUENCE)
# what --format / formats= can name -> the file it writes beside report.json; the command line's default: EXPORTS
REPORT_FILES = {"html": "report.html", "md": "report.md", "json": "metrics.json", "csv": "metrics.csv"}
EXPORTS = ("html", "md", "csv")
# what each embedding mode of the synthetic one-layer model freezes at its random init (ModelConfig flags)
EMBEDDING_MODES = {
    "trainable": (),                                   # every parameter learns
    "frozen": ("frozen_subjects",),                    # subject embeddings frozen (the paper's control)
    "frozen_all": ("frozen_subjects", "frozen_unembed"),   # subject embeddings and unembedding frozen
    "frozen_unembed": ("frozen_unembed",),             # the unembedding frozen, subject embeddings learn
}
MATCHED_MODES = ("trainable", "frozen")
MATCHED_FACTS = ("known", "all")                   # the matched controls' tables (synthetic.matched.FACTS)
MATCHED_RECIPES = ("adam", "weight_decay")           # the matched controls' optimiser recipes (synthetic.matched.RECIPES)          # subject embeddings of the matched synthetic models
SWEEP_MODES = ("trainable", "frozen", "frozen_all")        # the capacity sweep's modes (synthetic.sweep)
SWAP_MODES = ("trainable", "frozen", "frozen_unembed")     # the freeze-and-swap sweep's modes (synthetic.swap)
