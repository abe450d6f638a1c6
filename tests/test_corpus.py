"""The self-distilled corpus (dart_core.tools.training.corpus) on a tiny target with a word tokenizer: the prompt
pool, continuous batching against plain decoding, the captured states against a teacher-forced
forward, resuming, the exported corpus, the draft vocabulary, and training on answers only."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dart_core import GenerationParams, SamplingParams, Summary, generate, kernels
from dart_core.drafters.head import load_head
from dart_core.target import load_target
from dart_core.tools.data import iter_records
from dart_core.tools.training import TrainConfig, adopt_vocabulary, load_split, new_head_from_target, sample_anchors, train_dart
from dart_core.tools.training.corpus import (
    ContinuousBatcher,
    CorpusConfig,
    _Job,
    choose_draft_vocab,
    corpus_records,
    corpus_to_cache,
    export_corpus,
    generate_corpus,
    prompt_pool,
    read_corpus,
    run_batcher,
)

from support import build_tiny_checkpoint, save_word_tokenizer, sentence


@pytest.fixture(scope="module")
def word_checkpoint(tmp_path_factory):
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("corpusq3"), "qwen3", seed=3)
    save_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def word_target(word_checkpoint):
    return load_target(word_checkpoint, "cpu", "float32")


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")
    g = torch.Generator().manual_seed(1)
    share = [
        {
            "id": f"c{k}",
            "conversations": [
                {"from": "human", "value": sentence(g, 3 + k % 9)},
                {"from": "gpt", "value": sentence(g, 10)},
                {"from": "human", "value": sentence(g, 4)},
            ],
        }
        for k in range(30)
    ]
    share.append({"id": "dup", "conversations": [dict(share[0]["conversations"][0]), {"from": "gpt", "value": "w9"}]})
    alpaca = [{"instruction": sentence(g, 5), "input": "", "output": sentence(g, 8)} for _ in range(10)]
    bench = [{"question_id": 1, "category": "x", "turns": [alpaca[0]["instruction"], "w7"]}]
    (d / "share.jsonl").write_text("".join(json.dumps(r) + "\n" for r in share))
    (d / "alpaca.json").write_text(json.dumps(alpaca))
    (d / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bench))
    return d


def test_sharegpt_records_and_the_prompt_pool(prompt_files):
    recs = list(iter_records(prompt_files / "share.jsonl"))
    assert [m["role"] for m in recs[0]] == ["user", "assistant", "user"]
    with pytest.raises(ValueError, match="turn 0"):
        (prompt_files / "bad.jsonl").write_text(json.dumps({"conversations": [{"from": "bot", "value": "x"}]}) + "\n")
        list(iter_records(prompt_files / "bad.jsonl"))
    (prompt_files / "bad.jsonl").unlink()
    files = [str(prompt_files / "share.jsonl"), str(prompt_files / "alpaca.json")]
    pool = prompt_pool(files, exclude=[str(prompt_files / "bench.jsonl")], seed=0)
    texts = [p.messages[-1]["content"] for p in pool]
    assert len(pool) == 30 + 10 - 1  # the duplicate first prompt and the bench prompt are gone
    assert len(set(texts)) == len(texts)
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in pool)  # first turns only
    assert json.loads((prompt_files / "bench.jsonl").read_text())["turns"][0] not in texts
    assert [p.messages for p in prompt_pool(files, seed=0)] != [p.messages for p in prompt_pool(files, seed=1)]


def plain_greedy(target, ids, max_new):
    out = []
    for ev in generate(target, ids, None, GenerationParams(max_new_tokens=max_new, sampling=SamplingParams(temperature=0))):
        if not isinstance(ev, Summary):
            out += ev.new_tokens
    return out


@pytest.fixture(
    params=[pytest.param(True, marks=pytest.mark.skipif(not kernels.AVAILABLE, reason="no C++ kernels")), False], ids=["kernels", "eager"]
)
def use_kernels(request, word_target):
    """The target's forwards on the CPU kernels (decode_rows' rows exact) or on its eager torch path."""
    word_target.model.use_kernels = request.param
    yield request.param
    word_target.model.use_kernels = True


def test_continuous_batching_equals_plain_decoding_and_captures_the_states(word_target, use_kernels):
    g = torch.Generator().manual_seed(5)
    prompts = [word_target.encode(sentence(g, 2 + 3 * k)) for k in range(7)]
    # fewer rows than prompts: rows are refilled, and idle rows wait at the end
    batcher = ContinuousBatcher(word_target, slots=3, capacity=128, temperature=0.7, capture=True)
    results = {r.index: r for r in run_batcher(batcher, (_Job(k, p, None) for k, p in enumerate(prompts)), max_new=20)}
    assert sorted(results) == list(range(7))
    for k, p in enumerate(prompts):
        r = results[k]
        assert r.prompt == p
        assert r.answer == plain_greedy(word_target, p, 20)  # EOS included when emitted, as plain decoding's stream has it
        fed = p + r.answer[:-1]
        fwd = word_target.model(
            torch.tensor(fed), torch.arange(len(fed)), word_target.new_cache(len(fed)), capture=True, final=True, logits=False
        )
        assert r.aux.shape == (len(fed), 3 * word_target.hidden_size) and r.final.shape == (len(fed), word_target.hidden_size)
        torch.testing.assert_close(r.aux.float(), fwd.hidden.to(torch.bfloat16).float(), atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(r.final.float(), fwd.final.to(torch.bfloat16).float(), atol=3e-2, rtol=2e-2)


def test_sampled_rows_follow_the_tempered_distribution(word_target):
    batcher = ContinuousBatcher(word_target, slots=1, capacity=8, temperature=0.5, capture=False)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    job = _Job(0, [1], torch.Generator().manual_seed(0))
    n = 6000
    counts = np.bincount([batcher._pick(job, logits) for _ in range(n)], minlength=4)
    expected = torch.softmax(logits.double() / 0.5, -1).numpy()
    expected = expected / expected.sum() * n
    from scipy.stats import chisquare

    assert chisquare(counts, expected).pvalue > 1e-3
    assert batcher._pick(_Job(0, [1], None), logits) == 0  # no generator: greedy


def corpus_cfg(prompt_files, out, **kw):
    settings = dict(max_prompt_tokens=12, max_new_tokens=16, batch_size=4, sample_share=0.3, temperature=0.7, val_prompts=6)
    settings.update(kw)
    return CorpusConfig(
        data=[str(prompt_files / "share.jsonl"), str(prompt_files / "alpaca.json")],
        out_dir=str(out),
        exclude=[str(prompt_files / "bench.jsonl")],
        **settings,
    )


@pytest.mark.slow
def test_corpus_resumes_exports_and_rebuilds(word_target, prompt_files, tmp_path, monkeypatch):
    import dart_core.tools.training.corpus as corpus

    monkeypatch.setattr(corpus, "SHARD_TOKENS", 150)
    one = generate_corpus(word_target, corpus_cfg(prompt_files, tmp_path / "one"))
    two = tmp_path / "two"
    generate_corpus(word_target, corpus_cfg(prompt_files, two, max_prompts=17))  # interrupted ...
    assert len(json.loads((two / "meta.json").read_text())["corpus"]["done"]) == 17
    first = export_corpus(two, tmp_path / "export", "test")  # a milestone commit of what is done so far
    generate_corpus(word_target, corpus_cfg(prompt_files, two))  # ... and resumed
    with pytest.raises(ValueError, match="temperature"):
        generate_corpus(word_target, corpus_cfg(prompt_files, two, temperature=1.0))

    def by_index(run):
        return {r["index"]: r for r in corpus_records(run)}

    a, b = by_index(one), by_index(two)
    meta = json.loads((one / "meta.json").read_text())["corpus"]
    assert set(a) == set(b) and len(a) + len(meta["skipped"]) == meta["pool_size"] == 39
    assert meta["skipped"] and all(
        len(word_target.encode(p.messages)) > 12
        for p in [prompt_pool(corpus_cfg(prompt_files, one).data, corpus_cfg(prompt_files, one).exclude)[i] for i in meta["skipped"]]
    )
    for i, r in a.items():
        assert r["ids"] == b[i]["ids"]  # greedy and seeded sampling: a resumed run writes the same text
        assert r["split"] == ("val" if i < 6 else "train")
    sampled = [r for r in a.values() if r["sampled"]]
    assert 0 < len(sampled) < len(a)
    for r in a.values():
        if not r["sampled"]:
            assert r["ids"][r["answer_start"] :] == plain_greedy(word_target, r["ids"][: r["answer_start"]], 16)

    assert [p["name"] for p in first["parts"]] == ["part-00000.npz"] and 0 < first["records"] < len(a)
    exported = export_corpus(two, tmp_path / "export", "test")  # parts append: the next holds only the new records
    assert [p["name"] for p in exported["parts"]] == ["part-00000.npz", "part-00001.npz"] and exported["parts"][0] == first["parts"][0]
    assert exported["records"] == len(a) and exported["settings"]["temperature"] == 0.7
    assert export_corpus(one, tmp_path / "export", "test")["parts"] == exported["parts"]  # the same records again: no new part
    partial = export_corpus(two, tmp_path / "export2", "test", min_records=10_000)
    assert partial["parts"] == [] and partial["records"] == 0
    back = {r["index"]: r for r in read_corpus(tmp_path / "export")}
    assert back == a

    rebuilt = corpus_to_cache(word_target, tmp_path / "export", tmp_path / "rebuilt")
    for split in ("val", "train"):
        x = {int(r.tokens.sum()) * 1000 + r.tokens.numel(): r for r in load_split(one, split)}
        y = {int(r.tokens.sum()) * 1000 + r.tokens.numel(): r for r in load_split(rebuilt, split)}
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key].tokens, y[key].tokens) and x[key].answer_start == y[key].answer_start
            torch.testing.assert_close(x[key].aux.float(), y[key].aux.float(), atol=3e-2, rtol=2e-2)

    generate_corpus(word_target, corpus_cfg(prompt_files, tmp_path / "rebuilt"))  # a rebuilt run resumes: nothing left to do
    assert by_index(tmp_path / "rebuilt").keys() == a.keys()

    part = tmp_path / "export" / "part-00000.npz"
    part.write_bytes(part.read_bytes()[:-3] + b"xyz")
    with pytest.raises(ValueError, match="sha256"):
        list(read_corpus(tmp_path / "export"))


@pytest.mark.slow
def test_sigterm_keeps_the_finished_records_and_the_run_resumes(word_target, prompt_files, tmp_path, monkeypatch):
    import signal

    import dart_core.tools.training.corpus as corpus

    full = {r["index"]: r["ids"] for r in corpus_records(generate_corpus(word_target, corpus_cfg(prompt_files, tmp_path / "full")))}
    step, calls = corpus.ContinuousBatcher.step, []

    def step_then_signal(self):
        calls.append(1)
        if len(calls) == 40:
            signal.raise_signal(signal.SIGTERM)
        return step(self)

    monkeypatch.setattr(corpus.ContinuousBatcher, "step", step_then_signal)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        generate_corpus(word_target, corpus_cfg(prompt_files, run))
    assert stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    kept = {r["index"]: r["ids"] for r in corpus_records(run)}
    assert 0 < len(kept) < len(full) and all(full[i] == ids for i, ids in kept.items())  # finished records, flushed
    monkeypatch.setattr(corpus.ContinuousBatcher, "step", step)
    generate_corpus(word_target, corpus_cfg(prompt_files, run))
    assert {r["index"]: r["ids"] for r in corpus_records(run)} == full


@pytest.mark.slow
def test_a_run_resumed_in_another_dtype_records_it(word_checkpoint, word_target, prompt_files, tmp_path):
    run, out = tmp_path / "run", tmp_path / "export"
    generate_corpus(word_target, corpus_cfg(prompt_files, run, max_prompts=17))
    export_corpus(run, out, "test")
    generate_corpus(load_target(word_checkpoint, "cpu", "bfloat16"), corpus_cfg(prompt_files, run))
    recs = list(corpus_records(run))
    fp32 = {r["index"] for r in recs if r["dtype"] == "float32"}
    skipped = set(json.loads((run / "meta.json").read_text())["corpus"]["skipped"])
    assert fp32 == set(range(17)) - skipped and {r["dtype"] for r in recs} == {
        "float32",
        "bfloat16",
    }  # the first 17 pool prompts ran in fp32
    manifest = export_corpus(run, out, "test")
    assert [p["generated_dtype"] for p in manifest["parts"]] == ["float32", "bfloat16"]
    assert manifest["generated_dtype"] == "bfloat16+float32"
    assert [r["dtype"] for r in read_corpus(out)] == [r["dtype"] for r in sorted(recs, key=lambda r: (r["dtype"] != "float32", r["index"]))]
    rebuilt = corpus_to_cache(word_target, out, tmp_path / "rebuilt")  # the generation dtype survives a rebuild in another
    assert sorted((r["index"], r["dtype"]) for r in corpus_records(rebuilt)) == sorted((r["index"], r["dtype"]) for r in recs)


@pytest.mark.slow
def test_draft_vocab_coverage_and_answer_only_training(word_target, prompt_files, tmp_path, caplog):
    run = generate_corpus(word_target, corpus_cfg(prompt_files, tmp_path / "run"))
    with pytest.raises(ValueError, match="draft vocabulary"):
        train_dart(word_target, TrainConfig(cache_dir=str(run), out_dir=str(tmp_path / "t")), draft_length=3)
    recs = list(corpus_records(run))
    answers = [t for r in recs if not r["sampled"] for t in r["ids"][r["answer_start"] :]]
    info = choose_draft_vocab(run, 10, word_target.vocab_size)
    export_corpus(run, tmp_path / "export", "test")  # the vocabulary travels with the corpus and into a rebuild
    rebuilt = corpus_to_cache(word_target, tmp_path / "export", tmp_path / "rebuilt")
    assert json.loads((rebuilt / "draft_vocab.json").read_text())["draft_ids"] == info["draft_ids"]
    assert info["coverage_greedy_argmax"] == pytest.approx(sum(t in set(info["draft_ids"]) for t in answers) / len(answers))
    assert choose_draft_vocab(run, word_target.vocab_size, word_target.vocab_size)["coverage_greedy_argmax"] == 1.0
    assert not choose_draft_vocab(run, 10, word_target.vocab_size)["kept"]  # another size than the file's: chosen anew
    assert choose_draft_vocab(run, 10, word_target.vocab_size, rechoose=True)["draft_ids"] == info["draft_ids"]  # deterministic
    for rec in load_split(run, "train"):
        anchors = sample_anchors(rec.tokens.numel(), 4, torch.Generator().manual_seed(0), rec.first_anchor)
        assert anchors.numel() and int(anchors.min()) >= rec.answer_start - 1  # every root is an answer token
    head_dir = train_dart(
        word_target,
        TrainConfig(
            cache_dir=str(run), out_dir=str(tmp_path / "t"), epochs=1, batch_records=2, anchors_per_record=4, eval_every=1000, val_records=4
        ),
        draft_length=3,
    )
    assert (head_dir / "model.safetensors").exists()
    history = json.loads((tmp_path / "t" / "history.json").read_text())
    assert history and len(history[-1]["val_hit1"]) == 4

    # the corpus grows and its vocabulary is chosen again: a resumed run keeps the head's own
    first_ids = json.loads((run / "draft_vocab.json").read_text())["draft_ids"]
    again = choose_draft_vocab(run, 10, word_target.vocab_size)  # the same size again: kept, coverage measured anew
    assert again["kept"] and again["draft_ids"] == first_ids
    other = choose_draft_vocab(run, 12, word_target.vocab_size)["draft_ids"]  # another size: chosen anew
    assert other != first_ids
    with caplog.at_level("WARNING", logger="dart_core.tools.training.loop"):
        head_dir = train_dart(
            word_target,
            TrainConfig(
                cache_dir=str(run),
                out_dir=str(tmp_path / "t"),
                epochs=2,
                batch_records=2,
                anchors_per_record=4,
                eval_every=1000,
                val_records=4,
            ),
            draft_length=3,
        )
    assert "differs from the checkpoint's" in caplog.text
    head = load_head(head_dir, dart=True, target=word_target)
    assert (torch.arange(head.d2t.numel()) + head.d2t).tolist() == first_ids

    # asked to adopt the cache's vocabulary: shared ids keep their trained rows and moments, new ones
    # start from the target's LM head rows, and the run goes on from its step
    before = torch.load(tmp_path / "t" / "checkpoint.pt", weights_only=False)
    cfg = TrainConfig(
        cache_dir=str(run),
        out_dir=str(tmp_path / "t"),
        epochs=2,
        batch_records=2,
        anchors_per_record=4,
        eval_every=1000,
        val_records=4,
        adopt_cache_vocab=True,
    )
    names = [n for n, _ in new_head_from_target(word_target, torch.tensor(first_ids), 3).named_parameters()]
    moved = adopt_vocabulary(before, torch.tensor(other), word_target, names)
    lm = names.index("lm_head.weight")
    for j, t in enumerate(other):
        if t in first_ids:
            i = first_ids.index(t)
            assert torch.equal(moved["head"]["lm_head.weight"][j], before["head"]["lm_head.weight"][i])
            assert torch.equal(moved["opt"]["state"][lm]["exp_avg_sq"][j], before["opt"]["state"][lm]["exp_avg_sq"][i])
        else:
            assert torch.equal(moved["head"]["lm_head.weight"][j], word_target.model.output.weight[t].float())
            assert not moved["opt"]["state"][lm]["exp_avg"][j].any()
    assert moved["vocab_changes"] == [{"step": before["step"], "size": 12, "carried_over": len(set(other) & set(first_ids))}]
    with caplog.at_level("WARNING", logger="dart_core.tools.training.loop"):
        head_dir = train_dart(word_target, TrainConfig(**{**cfg.__dict__, "epochs": 3}), draft_length=3)
    assert "adopting the cache's draft vocabulary" in caplog.text
    head = load_head(head_dir, dart=True, target=word_target)
    assert (torch.arange(head.d2t.numel()) + head.d2t).tolist() == other
    after = torch.load(tmp_path / "t" / "checkpoint.pt", weights_only=False)
    assert after["step"] > before["step"] and after["vocab_changes"] == moved["vocab_changes"]


def test_sample_anchors_respects_the_first_anchor():
    g = torch.Generator().manual_seed(0)
    assert sample_anchors(10, 50, g, first=4).tolist() == [4, 5, 6, 7, 8]
    a = sample_anchors(100, 8, g, first=60)
    assert a.numel() == 8 and int(a.min()) >= 60 and int(a.max()) <= 98
    assert sample_anchors(10, 3, g).numel() == 3
