"""Decoders shared on their own: a run's decoder saved to a folder (decoder.safetensors + decoder.json + README.md)
and loaded back from it, from a run folder and from an offline Hugging Face hub cache, with the same tensors and
predictions; a decoder fitted by hand made shareable; the guards (another layer's states, a tampered card, an
uncached repo offline, a folder holding something else)."""
import json
import shutil
import time

import pytest
import torch
from huggingface_hub import constants as hub_constants
from tiny_models import D, save_tiny

import llmprobe.analyses.run
import llmprobe.model.known as known_module
from llmprobe.analyses.saved import DECODER_JSON, DECODER_README, DECODER_TENSORS, SavedDecoder, load_decoder
from llmprobe.geometry import LinearRelationOperator, RidgeDecoder
from llmprobe.jobs.probe import probe
from llmprobe.model.engine import logits_fn, relation_states
from llmprobe.model.loading import load_model

TEMPLATE = "The capital of {} is"
SUBJECTS = [f"Land{i}" for i in range(24)]
OPTIONS = dict(n_splits=2, n_boot=50, folds=3, max_val_pairs=3, max_test_pairs=5, max_swap_subjects=3,
               random_control=False, betas=(1.0,), ranks=(4,), edit_ranks=(8, 16), ridge_alphas=(0.1, 10.0))
SHA, NEWER = "0123456789abcdef0123456789abcdef01234567", "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(a tiny Llama probe's output folder with its lre and ridge decoders, that model loaded). ranks=(4,) makes
    the LRE's W rank 4, saved as its factors, with the untruncated J beside it."""
    tmp = tmp_path_factory.mktemp("shared")
    rows = [{"subject": s, "object": o} for s, o in zip(SUBJECTS, ["Paris", "Tokyo", "Rome", "Cairo"] * 6)]
    rel = tmp / "capital.json"
    rel.write_text(json.dumps({"name": "capital", "templates": [TEMPLATE], "neutral_templates": ["{}"],
                               "facts": rows}))
    model = str(save_tiny("llama", tmp / "llama"))
    real_run = llmprobe.analyses.run.run_analyses
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(known_module, "is_known", lambda text, obj: True)      # a random model knows nothing
        mp.setattr(llmprobe.analyses.run, "run_analyses", lambda *a, **k: real_run(*a, progress=False, **k))
        probe(model, relations=[str(rel)], layers="0,1,2", device="cpu", analyses="lre,ridge", out=tmp / "run",
              analysis_options=OPTIONS)
    return tmp / "run", load_model(model, device="cpu")


def hub_cache(root, repo: str, folder, commit: str) -> None:
    """Put ``folder``'s files in a Hugging Face hub cache at ``root`` as snapshot_download leaves them:
    models--user--name/snapshots/<commit>/<files>, and refs/main naming that commit (the latest one put)."""
    storage = root / ("models--" + repo.replace("/", "--"))
    shutil.copytree(folder, storage / "snapshots" / commit)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)


def same_decoder(a: SavedDecoder, b: SavedDecoder) -> bool:
    return (torch.equal(a.operator.W, b.operator.W) and torch.equal(a.operator.b, b.operator.b)
            and (a.J is None) == (b.J is None) and (a.J is None or torch.equal(a.J, b.J))
            and (a.operator.beta, a.operator.rank, a.info["edit_rank"]) == (b.operator.beta, b.operator.rank,
                                                                            b.info["edit_rank"]))


def test_a_run_decoder_saved_loads_back_from_its_folder_and_an_offline_hub_cache(run, tmp_path, monkeypatch):
    folder, lm = run
    decoder = load_decoder(folder, "capital")
    assert decoder.layer == decoder.info["layer"] and decoder.relation == "capital" and decoder.kind == "lre"
    assert set(decoder.factors) == {"W"} and decoder.J is not None          # W saved by the run as rank-4 factors
    assert decoder.info["template"] == TEMPLATE and decoder.info["metrics"]["test_faithfulness"]["n"] > 0
    decoder.save(tmp_path / "shared")
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == sorted([DECODER_JSON, DECODER_TENSORS,
                                                                              DECODER_README])
    card = json.loads((tmp_path / "shared" / DECODER_JSON).read_text())
    report = json.loads((folder / "report.json").read_text())
    assert (card["format"], card["format_version"], card["layer"], card["d_in"], card["d_out"]) == (
        "llmprobe-decoder", 1, report["analyses"]["relations"]["capital"]["selected"]["lre"]["layer"], D, D)
    assert card["model"]["weights"] == report["model"]["weights_hash"] and card["template"] == TEMPLATE
    assert isinstance(card["tensors"]["W"], list)                           # still the factors, not d x d

    local = SavedDecoder.from_pretrained(tmp_path / "shared")
    from_run = SavedDecoder.from_pretrained(folder, relation="capital")
    hub_cache(tmp_path / "hub", "user/capital", tmp_path / "shared", SHA)
    ridge = load_decoder(folder, "capital", "ridge")
    ridge.save(tmp_path / "ridge")
    hub_cache(tmp_path / "hub", "user/capital", tmp_path / "ridge", NEWER)            # main: the ridge decoder
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)   # as when the variable is set after the import
    from_hub = SavedDecoder.from_pretrained("user/capital", revision=SHA, cache_dir=tmp_path / "hub")
    for loaded in (local, from_run, from_hub):
        assert same_decoder(loaded, decoder) and loaded.info["template"] == TEMPLATE
    assert same_decoder(SavedDecoder.from_pretrained("user/capital", cache_dir=tmp_path / "hub"), ridge)

    ids = decoder.predict(lm, SUBJECTS)
    H = relation_states(lm, TEMPLATE, SUBJECTS, [decoder.layer]).H[decoder.layer]
    assert torch.equal(ids, logits_fn(lm)(decoder.operator(H.double())).argmax(-1))
    for loaded in (local, from_hub):
        assert torch.equal(loaded.predict(lm, SUBJECTS), ids)

    local.save(tmp_path / "again")                                        # saved again: the very same files
    for name in (DECODER_JSON, DECODER_TENSORS, DECODER_README):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "shared" / name).read_bytes()
    from_run = SavedDecoder.from_pretrained(folder, relation="capital", kind="ridge")
    assert same_decoder(from_run, ridge) and from_run.info["alpha"] in (0.1, 10.0)
    with pytest.raises(KeyError, match=r"holds the lre decoder of relation 'capital', not the ridge decoder"):
        SavedDecoder.from_pretrained(tmp_path / "shared", kind="ridge")
    with pytest.raises(ValueError, match="a run's folder of decoders: name the relation"):
        SavedDecoder.from_pretrained(folder)


def test_a_hand_fitted_decoder_is_saved_loaded_and_predicts_at_its_own_layer(run, tmp_path):
    _, lm = run
    states = relation_states(lm, TEMPLATE, SUBJECTS, [1, 2])
    targets = torch.randn(len(SUBJECTS), D, generator=torch.Generator().manual_seed(0)) * 30   # varied answers
    ridge = RidgeDecoder(alpha=0.1).fit(states.H[1], targets)
    decoder = SavedDecoder.from_operator(ridge, layer=1, relation="capital", model=lm, template=TEMPLATE)
    assert (decoder.kind, decoder.layer, decoder.info["alpha"]) == ("ridge", 1, 0.1)
    assert repr(decoder) == (f"SavedDecoder('capital', kind='ridge', layer=1, d_in={D} -> d_out={D}, beta=1, "
                             f"rank=None, model={lm.info['name']!r})")
    assert repr(ridge.operator_) == f"LinearRelationOperator(d_in={D} -> d_out={D}, beta=1, rank=None, dtype=float32)"
    decoder.save(tmp_path / "hand")
    back = SavedDecoder.from_pretrained(tmp_path / "hand")
    assert torch.equal(back.operator.W, ridge.W_.double()) and torch.equal(back.operator.b, ridge.b_.double())
    assert back.info["model"]["weights"] == lm.info["weights_hash"] and back.info["template"] == TEMPLATE

    ids = back.predict(lm, SUBJECTS)
    to_ids = logits_fn(lm)
    assert torch.equal(ids, to_ids(ridge.operator_(states.H[1].double())).argmax(-1))
    assert len(set(ids.tolist())) > 3                                     # answers that differ by subject
    assert not torch.equal(ids, to_ids(ridge.operator_(states.H[2].double())).argmax(-1))   # layer 2 reads else
    assert torch.equal(decoder.predict(lm, SUBJECTS), ids)

    lre = SavedDecoder.from_operator(LinearRelationOperator(ridge.W_, ridge.b_, 2.0, 3), layer=2, relation="r",
                                     model=lm.info, J=torch.eye(D), edit_rank=3)
    lre.save(tmp_path / "lre")
    loaded = SavedDecoder.from_pretrained(tmp_path / "lre")
    assert (loaded.kind, loaded.operator.beta, loaded.operator.rank, loaded.info["edit_rank"]) == ("lre", 2.0, 3, 3)
    assert torch.equal(loaded.J, torch.eye(D, dtype=torch.float64))
    with pytest.raises(ValueError, match="no saved template"):
        loaded.predict(lm, SUBJECTS)
    other = SavedDecoder.from_operator(ridge, layer=1, relation="capital", template=TEMPLATE,
                                       model={"name": "other", "weights": "sha256:other", "n_layers": 3})
    with pytest.warns(UserWarning, match=rf"fitted on weights sha256:other, and is read on weights "
                                         rf"{lm.info['weights_hash']}"):
        assert torch.equal(other.predict(lm, SUBJECTS), ids)
    with pytest.raises(ValueError, match=r"layer must be a block of the model \(0 \.\. 2\), got 3"):
        SavedDecoder.from_operator(ridge, layer=3, relation="capital", model=lm)


def test_apply_refuses_states_of_another_layer(run):
    folder, _ = run
    decoder = load_decoder(folder, "capital")
    h = torch.randn(4, D, dtype=torch.float64)
    assert torch.equal(decoder.apply(h, layer=decoder.layer), decoder.operator(h))
    wrong = (decoder.layer + 1) % 3
    with pytest.raises(ValueError, match=rf"reads the states of layer {decoder.layer} .*but h is of layer {wrong}"):
        decoder.apply(h, layer=wrong)


def test_a_tampered_card_is_refused_naming_the_file(run, tmp_path):
    folder, _ = run
    load_decoder(folder, "capital", "ridge").save(tmp_path / "d")
    card_file = tmp_path / "d" / DECODER_JSON
    card = json.loads(card_file.read_text())
    card_file.write_text(json.dumps({**card, "d_in": D - 1}))
    with pytest.raises(ValueError, match=rf"{card_file} \(its tensors in {DECODER_TENSORS}\): the tensors of W "
                                         rf"\['decoder.W'\] have shapes \[\({D}, {D}\)\], but d_in {D - 1}"):
        SavedDecoder.from_pretrained(tmp_path / "d")
    card_file.write_text(json.dumps({**card, "format_version": 2}))
    with pytest.raises(ValueError, match=rf"{card_file}: format_version 2; .* a newer llmprobe wrote it"):
        SavedDecoder.from_pretrained(tmp_path / "d")


def test_a_repo_not_cached_offline_fails_at_once(run, tmp_path, monkeypatch):
    folder, _ = run
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)   # set after huggingface_hub read it: still offline
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=r"hub repo 'user/absent' \(revision main\) is not in the local "
                                                r"Hugging Face cache .* offline \(HF_HUB_OFFLINE is set\): fetch "
                                                r"it once with network access \(`hf download user/absent`"):
        SavedDecoder.from_pretrained("user/absent", cache_dir=tmp_path / "hub")
    with pytest.raises(ConnectionError, match=r"cannot push to hub repo 'user/absent': offline"):
        load_decoder(folder, "capital").push_to_hub("user/absent")
    assert time.perf_counter() - start < 5                               # a bound, not a benchmark: no retries


def test_save_refuses_a_folder_holding_something_else(run, tmp_path):
    folder, _ = run
    decoder = load_decoder(folder, "capital", "ridge")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"is not empty \(it holds notes.txt\).*overwrite=True"):
        decoder.save(tmp_path)
    assert not (tmp_path / DECODER_JSON).exists()
    decoder.save(tmp_path, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert same_decoder(SavedDecoder.from_pretrained(tmp_path), decoder)


def test_the_readme_shows_user_strings_without_running_them(run, tmp_path):
    _, lm = run
    op = LinearRelationOperator(torch.eye(D), torch.zeros(D))
    name = "cap<script>alert(1)</script> | **x** \u202e\n# heading"
    SavedDecoder.from_operator(op, layer=0, relation=name, model=lm).save(tmp_path)
    readme = (tmp_path / DECODER_README).read_text()
    assert "<script>" not in readme and "\u202e" not in readme and "\n# heading" not in readme
    row = next(line for line in readme.splitlines() if line.startswith("| relation |"))
    assert row == ("| relation | cap&lt;script&gt;alert(1)&lt;/script&gt; \\| \\*\\*x\\*\\* \\\\u202e\\\\n# heading |")
    assert SavedDecoder.from_pretrained(tmp_path).relation == name      # the card keeps the name as it is
