"""The DART and EAGLE3 trainers on a tiny target with a real (word-level) tokenizer and chat template:
data formats, draft vocabulary, the prefix-packed mask, the schedule, the state cache, training
that resumes and exports a loadable head, self-distillation, and the CLI end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dart_core.drafters.head import load_head
from dart_core.target import load_target
from dart_core.tools.training import (
    SELF_DISTILL_FILE,
    CacheConfig,
    TrainConfig,
    build_cache,
    cache_meta,
    cosine_lr,
    dart_attention_mask,
    dart_record_loss,
    draft_vocabulary,
    load_split,
    new_head_from_target,
    train_dart,
    train_eagle3,
    vocab_mapping,
)

from support import build_tiny_checkpoint, save_word_tokenizer, sentence

D = 3


@pytest.fixture(scope="module")
def word_target(tmp_path_factory):
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("wordq3"), "qwen3", seed=2)
    save_word_tokenizer(path)
    return load_target(path, "cpu", "float32")


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    """One file per format of ../shared/data/train."""
    d = tmp_path_factory.mktemp("data")
    g = torch.Generator().manual_seed(0)
    alpaca = [{"instruction": sentence(g, 6), "input": sentence(g, 3) if k % 2 else "", "output": sentence(g, 20)} for k in range(12)]
    gpteacher = [{"instruction": sentence(g, 5), "input": "", "response": sentence(g, 18)} for _ in range(8)]
    t0 = [{"template": "t", "prompt": sentence(g, 15), "completion": sentence(g, 4)} for _ in range(8)]
    self_instruct = [
        {"instruction": sentence(g, 4), "instances": [{"input": sentence(g, 3), "output": sentence(g, 12)}] * 2} for _ in range(3)
    ]
    (d / "alpaca.json").write_text(json.dumps(alpaca))
    (d / "gpteacher.json").write_text(json.dumps(gpteacher))
    (d / "t0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in t0))
    (d / "self-instruct.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self_instruct))
    (d / "plain.txt").write_text("\n\n".join(sentence(g, 30) for _ in range(4)))
    return sorted(str(p) for p in d.iterdir())


def test_draft_vocabulary_and_mapping():
    ids = draft_vocabulary([[5, 5, 5, 9, 9, 2], [9, 7]], size=3, vocab_size=20)
    assert ids.tolist() == [2, 5, 9]  # 5 and 9 are the most frequent; 2 and 7 tie and the lower id wins
    filled = draft_vocabulary([[4, 4]], size=3, vocab_size=6)
    assert filled.tolist() == [0, 1, 4]  # fewer distinct tokens than the size: lowest unused ids fill in
    d2t, t2d = vocab_mapping(torch.tensor([2, 5, 9]), 12)
    assert (torch.arange(3) + d2t).tolist() == [2, 5, 9]  # d2t is an offset (upstream convention)
    assert t2d.nonzero().flatten().tolist() == [2, 5, 9] and t2d.dtype == torch.bool


def test_prefix_packed_mask():
    R, anchors = 6, torch.tensor([1, 4])
    mask, pos = dart_attention_mask(R, anchors, D)
    assert mask.shape == (R + 2 * D, R + 2 * D)
    assert torch.equal(mask[:R, :R], torch.ones(R, R, dtype=torch.bool).tril())  # real positions: causal
    assert not mask[:R, R:].any()  # real positions never see mask slots
    for b, a in enumerate(anchors.tolist()):
        for s in range(D):
            q = R + b * D + s
            assert mask[q, :R].tolist() == [k <= a for k in range(R)]  # the committed prefix 0..a
            own = [R + b * D + t for t in range(D)]
            assert mask[q, own].tolist() == [t <= s for t in range(D)]  # earlier slots of its own anchor
            others = [k for k in range(R, R + 2 * D) if k not in own]
            assert not mask[q, others].any()
            assert pos[q] == a + 1 + s  # slot s+1 continues the anchor's positions
    assert pos[:R].tolist() == list(range(R))


def test_cosine_schedule():
    lr = [cosine_lr(s, 100, 1.0, 10) for s in range(101)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lr[10:], lr[11:])) and lr[100] == pytest.approx(0.0)
    assert lr[55] == pytest.approx(0.5)
    # a time budget that runs out first pulls the decay forward, so a cut run still ends annealed
    assert cosine_lr(20, 100, 1.0, 10, time_progress=1.0) == pytest.approx(0.0)
    assert cosine_lr(20, 100, 1.0, 10, time_progress=0.5) == pytest.approx(0.5)
    assert cosine_lr(20, 100, 1.0, 10, time_progress=0.01) == pytest.approx(0.5 * (1 + math.cos(math.pi * 10 / 90)))


def test_loss_weights_follow_gamma(word_target):
    ids = list(range(10, 40))
    out = word_target.model(torch.tensor(ids), torch.arange(len(ids)), word_target.new_cache(64), capture=True, final=True, logits=False)
    from dart_core.tools.training import CachedRecord

    rec = CachedRecord(torch.tensor(ids), out.hidden.clone(), out.final.clone())  # out of inference mode
    head = new_head_from_target(word_target, torch.arange(40, 90), D)
    anchors = torch.tensor([0, 5, len(ids) - 2])  # the last possible anchor has one row with a teacher
    kl, w, hits, valid = dart_record_loss(
        head,
        word_target.model.tok_embeddings.weight,
        word_target.model.output.weight[40:90],
        rec,
        anchors,
        0.6,
        torch.zeros(len(ids), dtype=torch.long),
    )
    full = sum(0.6**j for j in range(D + 1))
    assert float(w) == pytest.approx(2 * full + 1.0)
    assert valid.sum(1).tolist() == [D + 1, D + 1, 1]
    assert float(kl.detach()) > 0 and hits.shape == (3, D + 1)


@pytest.mark.slow
def test_cache_train_resume_export(word_target, data_files, tmp_path):
    cache_dir = tmp_path / "cache"
    cfg = CacheConfig(data=data_files, out_dir=str(cache_dir), max_tokens=10_000, val_records=4, draft_vocab_size=48)
    build_cache(word_target, cfg)
    meta = cache_meta(cache_dir)
    train, val = load_split(cache_dir, "train"), load_split(cache_dir, "val")
    assert len(val) == 4 and len(train) == 12 + 8 + 8 + 6 + 4 - 4  # 38 records, 4 held out
    assert meta["tokens"]["train"] == sum(r.tokens.numel() for r in train)
    assert train[0].aux.shape == (train[0].tokens.numel(), 3 * word_target.hidden_size)
    assert train[0].final.shape == (train[0].tokens.numel(), word_target.hidden_size)
    assert train[0].aux.dtype == torch.bfloat16
    assert len(meta["draft_ids"]) == 48
    # the cached states are the target's: recompute one record
    ids = train[1].tokens
    out = word_target.model(ids, torch.arange(len(ids)), word_target.new_cache(len(ids)), capture=True, final=True, logits=False)
    torch.testing.assert_close(train[1].aux.float(), out.hidden, atol=0.05, rtol=0.02)
    build_cache(word_target, cfg)  # resuming a finished cache adds nothing
    assert cache_meta(cache_dir)["tokens"] == meta["tokens"]

    tcfg = TrainConfig(
        cache_dir=str(cache_dir),
        out_dir=str(tmp_path / "train"),
        epochs=2,
        lr=5e-3,
        warmup_steps=2,
        batch_records=4,
        anchors_per_record=8,
        eval_every=4,
    )
    head_dir = train_dart(word_target, tcfg, draft_length=D)
    history = json.loads((tmp_path / "train" / "history.json").read_text())
    assert history[-1]["step"] == 2 * 9  # 34 training records, 4 per step: 9 steps per epoch
    assert len(history[-1]["val_hit1"]) == D + 1  # per-position validation accuracy
    assert history[-1]["val_kl"] < history[0]["val_kl"]
    head = load_head(head_dir, dart=True, target=word_target)
    assert head.config.draft_length == D and head.config.draft_vocab_size == 48
    assert (torch.arange(48) + head.d2t).tolist() == meta["draft_ids"]

    # resume with a longer schedule: continues from the checkpoint instead of starting over
    train_dart(word_target, TrainConfig(**{**tcfg.__dict__, "epochs": 3, "keep_heads_every": 5}), draft_length=D)
    history = json.loads((tmp_path / "train" / "history.json").read_text())
    assert [h["step"] for h in history] == [4, 8, 12, 16, 18, 20, 24, 27]
    kept = sorted((tmp_path / "train" / "heads").iterdir())  # every 5th step of the resumed part
    assert [k.name for k in kept] == ["step-000020", "step-000025"]
    assert json.loads((kept[0] / "trained.json").read_text())["step"] == 20
    assert load_head(kept[1], dart=True, target=word_target).config.draft_length == D

    # and with fewer mask slots (the weights do not depend on D): rows 1..D'+1 go on training
    head_dir = train_dart(word_target, TrainConfig(**{**tcfg.__dict__, "epochs": 4}), draft_length=D - 1)
    history = json.loads((tmp_path / "train" / "history.json").read_text())
    assert history[-1]["step"] == 36 and len(history[-1]["val_hit1"]) == D and len(history[0]["val_hit1"]) == D + 1
    assert load_head(head_dir, dart=True, target=word_target).config.draft_length == D - 1


@pytest.mark.slow
def test_a_new_run_starts_from_a_saved_head(word_target, data_files, tmp_path, monkeypatch):
    """A machine that lost the run directory goes on from the committed head: its weights, step,
    training time and history; fresh optimizer moments with a new warm-up."""
    from dart_core.tools.training import loop

    cache_dir = tmp_path / "cache"
    build_cache(word_target, CacheConfig(data=data_files, out_dir=str(cache_dir), max_tokens=4_000, val_records=4, draft_vocab_size=32))
    first = TrainConfig(
        cache_dir=str(cache_dir),
        out_dir=str(tmp_path / "a"),
        steps=8,
        warmup_steps=2,
        batch_records=2,
        anchors_per_record=4,
        eval_every=4,
        keep_heads_every=8,
    )
    train_dart(word_target, first, draft_length=D)
    saved = tmp_path / "a" / "heads" / "step-000008"
    trained = json.loads((saved / "trained.json").read_text())
    history = tmp_path / "a" / "history.json"

    lrs = []
    cosine = loop.cosine_lr
    second = TrainConfig(
        **{
            **first.__dict__,
            "out_dir": str(tmp_path / "b"),
            "steps": 12,
            "keep_heads_every": None,
            "init_head": str(saved),
            "init_history": str(history),
        }
    )
    monkeypatch.setattr(loop, "cosine_lr", lambda *a: lrs.append(cosine(*a)) or lrs[-1])
    train_dart(word_target, second, draft_length=D)
    monkeypatch.undo()
    ck = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 12 and ck["restarts"] == [{"step": 8, "from": str(saved), "optimizer": "fresh"}]
    assert [h["step"] for h in ck["history"]] == [4, 8, 12]  # the first run's entries, then this one's
    assert ck["elapsed_s"] > trained["elapsed_s"]
    assert len(lrs) == 4  # steps 8..11; the warm-up starts again at the restart, towards the schedule's value
    assert lrs[0] == pytest.approx(cosine(8, 12, first.lr, 2) / 2) and lrs[1] == pytest.approx(cosine(9, 12, first.lr, 2))
    started = json.loads(history.read_text())
    assert ck["history"][:2] == started[:2]

    # the same weights as the saved head at the start: a run with no step to make saves it unchanged
    third = TrainConfig(**{**second.__dict__, "out_dir": str(tmp_path / "c"), "steps": 8})
    train_dart(word_target, third, draft_length=D)
    reloaded = load_head(tmp_path / "c" / "head", dart=True, target=word_target)
    original = load_head(saved, dart=True, target=word_target)
    for (k, a), b in zip(original.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), k

    # a head of the other objective, or a malformed trained.json, is refused with a message
    with pytest.raises(ValueError, match="draft_length|DART|EAGLE3"):
        train_eagle3(word_target, TrainConfig(**{**second.__dict__, "out_dir": str(tmp_path / "d")}), ttt_steps=2)
    (saved / "trained.json").write_text('{"step": "eight"}')
    with pytest.raises(ValueError, match="trained.json"):
        train_dart(word_target, TrainConfig(**{**second.__dict__, "out_dir": str(tmp_path / "e")}), draft_length=D)


@pytest.mark.slow
def test_time_budget_stops_and_evaluates(word_target, data_files, tmp_path):
    cache_dir = tmp_path / "cache"
    build_cache(word_target, CacheConfig(data=data_files, out_dir=str(cache_dir), max_tokens=2_000, val_records=4, draft_vocab_size=32))
    cfg = TrainConfig(cache_dir=str(cache_dir), out_dir=str(tmp_path / "train"), epochs=100, max_minutes=0.0, eval_every=1000)
    train_dart(word_target, cfg, draft_length=D)
    history = json.loads((tmp_path / "train" / "history.json").read_text())
    assert [h["step"] for h in history] == [0]  # no step fits, but the head is still evaluated and saved
    assert (tmp_path / "train" / "head" / "model.safetensors").is_file()


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_run_resumes_from_it(word_target, data_files, tmp_path, monkeypatch):
    import signal

    from dart_core.tools.training import loop

    cache_dir = tmp_path / "cache"
    build_cache(word_target, CacheConfig(data=data_files, out_dir=str(cache_dir), max_tokens=4_000, val_records=4, draft_vocab_size=32))
    cfg = TrainConfig(
        cache_dir=str(cache_dir), out_dir=str(tmp_path / "train"), epochs=100, batch_records=2, anchors_per_record=4, eval_every=1000
    )
    calls = []
    sample = loop.sample_anchors

    def sample_then_signal(*args):  # SIGTERM arrives mid-step 3 (2 records a step)
        calls.append(1)
        if len(calls) == 5:
            signal.raise_signal(signal.SIGTERM)
        return sample(*args)

    monkeypatch.setattr(loop, "sample_anchors", sample_then_signal)
    with pytest.raises(SystemExit) as stopped:
        train_dart(word_target, cfg, draft_length=D)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone with the loop
    ck = torch.load(tmp_path / "train" / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 3  # the step in progress finished, then the loop stopped
    monkeypatch.setattr(loop, "sample_anchors", sample)
    train_dart(word_target, TrainConfig(**{**cfg.__dict__, "epochs": 0.5}), draft_length=D)
    assert torch.load(tmp_path / "train" / "checkpoint.pt", weights_only=False)["step"] > 3
    train_dart(word_target, TrainConfig(**{**cfg.__dict__, "steps": 11}), draft_length=D)  # steps override epochs
    assert torch.load(tmp_path / "train" / "checkpoint.pt", weights_only=False)["step"] == 11


@pytest.mark.slow
def test_self_distillation(word_target, data_files, tmp_path):
    from dart_core.generate import GenerationParams, complete

    cfg = CacheConfig(
        data=data_files,
        out_dir=str(tmp_path / "c"),
        max_tokens=10_000,
        val_records=4,
        draft_vocab_size=32,
        self_distill=7,
        self_distill_max_new=6,
        self_distill_batch=3,
    )
    build_cache(word_target, cfg)
    rows = [json.loads(line) for line in (tmp_path / "c" / SELF_DISTILL_FILE).read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == [i for i in range(7) if i in {r["index"] for r in rows}] and len(rows) >= 5
    records = load_split(tmp_path / "c", "val") + load_split(tmp_path / "c", "train")
    checked = 0
    for r in rows:
        answer = word_target.tokenizer(r["response"], add_special_tokens=False)["input_ids"]
        if not answer:
            continue
        # a cached record ends with the target's answer (then the end-of-turn token)
        hits = [rec.tokens.tolist() for rec in records if rec.tokens.tolist()[-len(answer) - 1 : -1] == answer]
        assert hits, r
        if len(answer) == 6:  # not stopped by EOS: the answer's tokens are exactly the generated ones
            # batched, left-padded generation gives the target's own greedy answer (fp32)
            solo = complete(word_target, hits[0][: -len(answer) - 1], None, GenerationParams(6)).output_ids
            assert solo == answer
            checked += 1
    assert checked >= 1


@pytest.mark.slow
def test_cli_end_to_end(word_target, data_files, tmp_path, capsys):
    """dart-train dart, then dart-train eagle3 on its cache: the console script's function (cli) run in
    this process with the command line's arguments (a fresh process per command cost ~7 s of start-up
    each on 2 cores; that every command is its console script is test_layers')."""
    from dart_core.cli.train import cli

    cmd = [
        "dart",
        "--model",
        str(word_target.model_dir),
        "--data",
        *data_files,
        "--work",
        str(tmp_path / "w"),
        "--device",
        "cpu",
        "--cache-tokens",
        "3000",
        "--val-records",
        "3",
        "--draft-vocab",
        "40",
        "--draft-length",
        "2",
        "--epochs",
        "1",
        "--batch-records",
        "8",
        "--anchors",
        "4",
        "--eval-every",
        "2",
        "--export",
        str(tmp_path / "head"),
    ]
    assert cli(cmd) == 0
    head = load_head(tmp_path / "head", dart=True, target=word_target)
    assert head.config.draft_length == 2 and head.config.draft_vocab_size == 40
    # EAGLE3 on the same cache: the cache is reused as it is, the head is an EAGLE3 head
    capsys.readouterr()
    cmd = [
        "eagle3",
        "--model",
        str(word_target.model_dir),
        "--data",
        *data_files,
        "--work",
        str(tmp_path / "e3"),
        "--cache",
        str(tmp_path / "w" / "cache"),
        "--device",
        "cpu",
        "--ttt-steps",
        "2",
        "--epochs",
        "1",
        "--batch-records",
        "8",
        "--anchors",
        "4",
        "--eval-every",
        "2",
        "--export",
        str(tmp_path / "e3head"),
    ]
    assert cli(cmd) == 0
    assert "reusing the cache" in capsys.readouterr().err
    head = load_head(tmp_path / "e3head", dart=False, target=word_target)
    assert head.config.draft_length is None and head.config.draft_vocab_size == 40
    assert len(json.loads((tmp_path / "e3" / "train" / "history.json").read_text())[-1]["val_hit1"]) == 3


@pytest.mark.slow
def test_eagle3_training_learns_and_refuses_a_dart_checkpoint(word_target, data_files, tmp_path):
    cache_dir = tmp_path / "cache"
    build_cache(word_target, CacheConfig(data=data_files, out_dir=str(cache_dir), max_tokens=10_000, val_records=4, draft_vocab_size=48))
    cfg = TrainConfig(
        cache_dir=str(cache_dir),
        out_dir=str(tmp_path / "train"),
        epochs=2,
        lr=5e-3,
        warmup_steps=2,
        batch_records=4,
        anchors_per_record=8,
        eval_every=4,
    )
    head_dir = train_eagle3(word_target, cfg, ttt_steps=3)
    history = json.loads((tmp_path / "train" / "history.json").read_text())
    assert len(history[-1]["val_hit1"]) == 4
    assert history[-1]["val_kl"] < history[0]["val_kl"]
    assert load_head(head_dir, dart=False, target=word_target).config.draft_length is None
    with pytest.raises(ValueError, match="eagle3 checkpoint"):  # resuming the wrong objective is refused
        train_dart(word_target, cfg, draft_length=D)


def test_a_cache_is_not_resumed_with_other_data_settings(word_target, data_files, tmp_path):
    cfg = CacheConfig(data=data_files, out_dir=str(tmp_path / "c"), max_tokens=2_000, val_records=4, draft_vocab_size=32)
    build_cache(word_target, cfg)
    with pytest.raises(ValueError, match="val_records"):
        build_cache(word_target, CacheConfig(**{**cfg.__dict__, "val_records": 5}))


def test_bf16_autocast_only_where_the_hardware_has_bf16(monkeypatch):
    """Training autocasts to bf16 on a GPU or a CPU with AVX512-BF16; on other CPUs torch emulates bf16
    matmuls (~8x slower than fp32 for an EAGLE3 step on an AVX2 EPYC), so it trains in fp32."""
    from dart_core import kernels
    from dart_core.tools.training.loop import bf16_arithmetic

    monkeypatch.setattr(kernels, "cpu_features", lambda: {"avx2": True, "avx512bf16": True})
    assert bf16_arithmetic(torch.device("cpu"))
    monkeypatch.setattr(kernels, "cpu_features", lambda: {"avx2": True, "avx512bf16": False})
    assert not bf16_arithmetic(torch.device("cpu"))
    monkeypatch.setattr(kernels, "cpu_features", lambda: {})  # no generic build to ask: fp32
    assert not bf16_arithmetic(torch.device("cpu"))
    assert bf16_arithmetic(torch.device("cuda"))
