"""The calibration split in order of length (``hf_evon.trainer.calibration_data.length_sorted``)
and its long tail cut (``cut_by_length``): the same examples, short per-batch padding, and the
same calibration as the dataset's order."""

from __future__ import annotations

import pytest
import torch
from conftest import stop_persistent_workers
from datasets import Dataset
from test_trainer import config, tiny_bert

from hf_evon import EVONTrainer, calibrate_posterior
from hf_evon.trainer.calibration_data import cut_by_length, length_sorted


def ragged_classification(n: int, seed: int) -> Dataset:
    """Texts of 2 to 20 tokens in random order; the label is learnable from the first token."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 21, (n,), generator=g).tolist()
    ids = [torch.randint(3, 100, (k,), generator=g).tolist() for k in lengths]
    return Dataset.from_dict({"input_ids": ids, "labels": [row[0] % 3 for row in ids]})


def padded_tokens(lengths: list[int], batch_size: int) -> int:
    """Tokens of consecutive batches of ``batch_size`` examples, each padded to its longest."""
    batches = [lengths[k : k + batch_size] for k in range(0, len(lengths), batch_size)]
    return sum(max(batch) * len(batch) for batch in batches)


def pad(features: list[dict]) -> dict[str, torch.Tensor]:
    """Pads each batch to its longest example, as ``DataCollatorWithPadding`` does."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros(len(features), width, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([f["labels"] for f in features])}


def test_length_sorted_keeps_the_examples_and_orders_them_by_token_count() -> None:
    data = ragged_classification(40, seed=1)
    ordered = length_sorted(data)
    lengths = [len(x) for x in ordered["input_ids"]]
    assert lengths == sorted(lengths) and lengths != [len(x) for x in data["input_ids"]]
    key = lambda row: (tuple(row[0]), row[1])  # noqa: E731
    assert sorted(map(key, zip(ordered["input_ids"], ordered["labels"]))) == sorted(
        map(key, zip(data["input_ids"], data["labels"]))
    )
    rows = [{"input_ids": torch.arange(k), "labels": k} for k in (5, 2, 9, 2)]  # a map-style dataset
    subset = length_sorted(rows)
    assert [subset[i]["labels"] for i in range(len(subset))] == [2, 2, 5, 9]  # stable
    assert length_sorted(ordered) is ordered  # already in order
    images = Dataset.from_dict({"pixel_values": [[0.0, 1.0]] * 3, "labels": [0, 1, 2]})
    assert length_sorted(images) is images  # no token ids
    scalars = [{"input_ids": torch.tensor(3), "labels": 0}, {"input_ids": torch.tensor(1), "labels": 1}]
    assert length_sorted(scalars) is scalars  # no token count to sort by
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # noqa: ANN204
            return iter(rows)

    stream = Stream()
    assert length_sorted(stream) is stream  # no length: read as it comes
    # where the order changes what is scored: a dropped last batch, padding on the left
    assert length_sorted(data, drop_last=True) is data
    left, right = (type("Collator", (), {"tokenizer": type("T", (), {"padding_side": s})()})() for s in ("left", "right"))
    assert length_sorted(data, left) is data and length_sorted(data, right)["input_ids"] == ordered["input_ids"]


def test_length_sorted_returns_an_iterable_dataset_as_it_is_even_with_a_length() -> None:
    """An ``IterableDataset`` with ``__len__`` (or wrapped in accelerate's ``IterableDatasetShard``, which
    ``evaluate()``'s BMA passes under DDP with ``dispatch_batches=False`` get) passed the Sized check
    and was indexed: ``NotImplementedError`` from ``dataset[0]``, or ``TypeError`` from the shard's
    ``len()`` of an unsized stream, so ``calibrate()`` and the BMA metrics of such a split crashed."""
    from accelerate.data_loader import IterableDatasetShard

    rows = [{"input_ids": torch.arange(k), "labels": k} for k in (5, 2, 9, 2)]

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # noqa: ANN204
            return iter(rows)

    class SizedStream(Stream):
        def __len__(self) -> int:
            return len(rows)

    for dataset in (SizedStream(), IterableDatasetShard(Stream(), batch_size=2, num_processes=2)):
        assert length_sorted(dataset) is dataset, type(dataset).__name__


def test_trainer_calibrates_in_order_of_length_as_in_the_datasets_order(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``EVONTrainer.calibrate`` reads the split by length, the long tail cut: its batches pad as
    ``cut_by_length`` cuts the sorted batches (fewer tokens than the sorted batches, which pad fewer
    than the dataset's order), and the result is the one ``calibrate_posterior`` gives
    on the batches in the dataset's order (the same examples, seeds and targets)."""
    trainer = EVONTrainer(
        model=tiny_bert(),
        args=config(tmp_path, max_steps=6, per_device_eval_batch_size=8),
        train_dataset=ragged_classification(48, seed=0),
        data_collator=pad,
    )
    trainer.train()
    held_out = ragged_classification(40, seed=2)
    posterior = trainer.current_posterior()
    in_order = [trainer._prepare_inputs(b) for b in trainer.get_eval_dataloader(held_out)]
    kwargs = dict(grid=(1.0, 0.3, 0.1), num_samples=3, always_scan=True, screen_factor=0.0)
    _, expected = calibrate_posterior(
        trainer.model, posterior, in_order, seed=trainer.args.bma_seed, shift_labels=False, **kwargs
    )
    seen = []
    import hf_evon.predictive.calibration as calibration

    def spy(model, posterior, batches, **kw):  # noqa: ANN001, ANN003
        seen.extend(batches)
        return calibrate_posterior(model, posterior, batches, **kw)

    monkeypatch.setattr(calibration, "calibrate_posterior", spy)
    result = trainer.calibrate(held_out, **kwargs)
    padded = lambda batches: sum(b["input_ids"].numel() for b in batches)  # noqa: E731
    lengths = [len(ids) for ids in held_out["input_ids"]]
    sorted_batches = padded_tokens(sorted(lengths), 8)
    assert padded(seen) < sorted_batches < padded(in_order) == padded_tokens(lengths, 8)
    assert padded(seen) == padded(cut_by_length([pad(list(length_sorted(held_out))[k : k + 8]) for k in range(0, 40, 8)]))
    assert sum(int(b["attention_mask"].sum()) for b in seen) == sum(int(b["attention_mask"].sum()) for b in in_order)
    assert result.grid == expected.grid and len(result.nll) == 3 and result.ess == expected.ess
    torch.testing.assert_close(torch.tensor(result.nll), torch.tensor(expected.nll), rtol=1e-5, atol=0)
    assert result.mean_nll == pytest.approx(expected.mean_nll, rel=1e-6)
    assert result.temperature == expected.temperature


def test_the_calibration_scores_every_example_under_dataloader_drop_last(tmp_path) -> None:
    """With ``dataloader_drop_last=True`` the calibration read the split through the Trainer's eval loader,
    which drops the last batch: 30 examples in batches of 16 were calibrated on 16 (the summary said "16
    targets"), and a split of 20 in batches of 32 was refused as having "no labelled target"."""
    for n, batch in ((30, 16), (20, 32)):
        held_out = ragged_classification(n, seed=2)
        trainer = EVONTrainer(
            model=tiny_bert(),
            args=config(tmp_path / f"{n}", max_steps=2, per_device_eval_batch_size=batch, dataloader_drop_last=True),
            train_dataset=ragged_classification(32, seed=0), data_collator=pad, calibration_dataset=held_out,
        )  # fmt: skip
        trainer.train()  # checks the split before the first step, calibrates after the last
        assert trainer.calibration.num_targets == n
        assert trainer.calibrate(held_out, grid=(1.0, 0.1), num_samples=2, always_scan=True).num_targets == n


def test_the_calibration_split_and_the_eval_set_keep_their_own_loaders_with_persistent_workers(tmp_path) -> None:
    """With ``dataloader_persistent_workers`` the Trainer caches one eval loader under one key for
    whatever dataset ``get_eval_dataloader`` is given: the calibration split's loader (built by the
    check before the first step) replaced the eval set's, so ``evaluate()`` reported on the
    calibration split, and a calibration after ``evaluate()`` ran on the eval set."""
    from test_trainer import classification_data

    eval_set, calibration_set = classification_data(40, seed=1), classification_data(24, seed=2)
    trainer = EVONTrainer(
        model=tiny_bert(),
        args=config(tmp_path, max_steps=2, dataloader_num_workers=1, dataloader_persistent_workers=True),
        train_dataset=classification_data(32),
        eval_dataset=eval_set,
        calibration_dataset=calibration_set,
    )
    try:
        trainer.train()  # the calibration split is checked before the first step and calibrated after the last
        assert trainer.calibration.num_targets == len(calibration_set)
        assert len(trainer.get_eval_dataloader().dataset) == len(eval_set)
        trainer.evaluate()
        assert trainer.calibrate().num_targets == len(calibration_set)
        assert len(trainer.get_eval_dataloader().dataset) == len(eval_set)
        assert trainer.args.dataloader_persistent_workers
    finally:
        stop_persistent_workers(trainer)


def test_evaluate_takes_its_bma_passes_in_order_of_length_with_the_same_metrics(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``evaluate()``'s S sampled passes read the eval set by length (the sorted lengths' padding); its
    ``eval_bma_*`` and ``eval_mean_*`` metrics are those of the passes in the dataset's order."""
    import hf_evon.trainer.evaluation as evaluation

    trainer = EVONTrainer(
        model=tiny_bert(),
        args=config(tmp_path, max_steps=6, per_device_eval_batch_size=8, bma_num_samples=3),
        train_dataset=ragged_classification(48, seed=0),
        eval_dataset=ragged_classification(40, seed=3),
        data_collator=pad,
    )
    trainer.train()
    padded = []
    sample_passes = evaluation.sample_passes

    def spy(trainer, dataloader, *args):  # noqa: ANN001, ANN002
        padded.append(sum(b["input_ids"].numel() for b in dataloader))
        return sample_passes(trainer, dataloader, *args)

    monkeypatch.setattr(evaluation, "sample_passes", spy)
    by_length = trainer.evaluate()
    monkeypatch.setattr(evaluation, "length_sorted", lambda dataset, *_: dataset)
    in_order = trainer.evaluate()
    lengths = [len(ids) for ids in trainer.eval_dataset["input_ids"]]
    assert padded[0] == padded_tokens(sorted(lengths), 8) < padded[1] == padded_tokens(lengths, 8)
    bma = [k for k in in_order if k.startswith("eval_bma_")]
    assert {"eval_bma_nll", "eval_bma_accuracy", "eval_bma_ece", "eval_bma_brier"} <= set(bma)
    for key in bma + [k for k in in_order if k.startswith("eval_mean_")]:
        assert by_length[key] == pytest.approx(in_order[key], rel=1e-5, abs=1e-7), key
    assert len(trainer.get_eval_dataloader().dataset["input_ids"]) == 40


DDP_WORKER = """
import os, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
from test_calibration_data import pad, ragged_classification
from test_trainer import config, tiny_bert
import hf_evon.trainer.evaluation as evaluation
from hf_evon import EVONTrainer

out = Path(sys.argv[2])
args = config(out, max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4, ddp_backend="gloo",
              bma_num_samples=2)
trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=ragged_classification(48, 0),
                      eval_dataset=ragged_classification(37, 3), data_collator=pad)
trainer.train()
lengths = [len(ids) for ids in trainer._length_sorted_loader(trainer.get_eval_dataloader()).dataset["input_ids"]]
assert lengths == sorted(lengths) != [len(ids) for ids in trainer.eval_dataset["input_ids"]]
by_length = trainer.evaluate()
evaluation.length_sorted = lambda dataset, *_: dataset
in_order = trainer.evaluate()
keys = [k for k in in_order if k.startswith(("eval_bma_", "eval_mean_"))]
torch.save({k: (by_length[k], in_order[k]) for k in keys}, out / f"rank{os.environ['RANK']}.pt")
torch.distributed.barrier()
from launcher import finish  # ends the worker before gloo's destructors can abort or hang it
finish()
"""


def test_evaluate_in_order_of_length_under_ddp_gives_the_metrics_of_the_datasets_order(tmp_path) -> None:
    """Two gloo ranks, 37 ragged examples (an uneven split, which the gather must not count twice):
    the length-sorted BMA passes give every rank the metrics of the passes in the dataset's order."""
    from pathlib import Path

    from launcher import torchrun

    worker = tmp_path / "worker.py"
    worker.write_text(DDP_WORKER)
    tests = Path(__file__).parent
    torchrun(2, str(worker), str(tests), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0] == ranks[1] and {"eval_bma_nll", "eval_bma_accuracy"} <= set(ranks[0])
    for key, (by_length, in_order) in ranks[0].items():
        assert by_length == pytest.approx(in_order, rel=1e-5, abs=1e-7), key
    assert ranks[0]["eval_bma_accuracy"][1] * 37 == pytest.approx(round(ranks[0]["eval_bma_accuracy"][1] * 37))


def test_cut_by_length_splits_the_long_tail_and_keeps_every_token_mask_and_label() -> None:
    """Runs of consecutive rows padded to at most R × L̄ tokens (R the most rows in a batch, L̄ the
    mean token count): lengths [1, 2, 2, 9] and [3, 3, 3, 3] give L̄ = 26 / 8 and a budget of 13, so
    the first batch (4 × 9 = 36 tokens) becomes rows 0-2 trimmed to 2 columns (6) and row 3 (9);
    the second (12) is kept as it is. Every row keeps its tokens, mask, token types and labels."""
    g = torch.Generator().manual_seed(0)

    def batch(lengths: list[int]) -> dict[str, torch.Tensor]:
        width = max(lengths)
        mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
        ids = torch.randint(3, 100, (len(lengths), width), generator=g) * mask
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "token_type_ids": mask.clone(),
            "labels": torch.randint(0, 3, (len(lengths),), generator=g),
            "weights": torch.rand(len(lengths), 2, generator=g),  # a per-row value: cut by rows only
        }

    first, second = batch([1, 2, 2, 9]), batch([3, 3, 3, 3])
    cut = cut_by_length([first, second])
    assert [b["input_ids"].shape for b in cut] == [(3, 2), (1, 9), (4, 3)]
    assert cut[2] is second
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(cut[0][key], first[key][:3, :2]) and torch.equal(cut[1][key], first[key][3:])
    for key in ("labels", "weights"):
        assert torch.equal(torch.cat([cut[0][key], cut[1][key]]), first[key])
    # a padded width beyond the longest example (padding="max_length") is trimmed, the rows kept
    wide = batch([3, 3])
    wide = {k: torch.cat([v, torch.zeros_like(v)], 1) if v.shape[1:] == (3,) else v for k, v in wide.items()}
    (trimmed,) = cut_by_length([wide])
    assert trimmed["input_ids"].shape == (2, 3) and torch.equal(trimmed["input_ids"], wide["input_ids"][:, :3])
    # token labels are cut with the tokens where they ignore every padded position
    tokens = batch([1, 2, 2, 9])
    tokens["labels"] = tokens["input_ids"].masked_fill(tokens["attention_mask"] == 0, -100)
    assert [b["labels"].shape for b in cut_by_length([tokens])] == [(3, 2), (1, 9)]


def test_cut_by_length_keeps_batches_it_cannot_cut_safely() -> None:
    """Left padding (trimming would move the tokens' positions), a value as long as the sequence
    that is not known to be aligned with it (float targets, token labels that do not ignore the
    padding: a decoder's), a non-tensor value, no attention mask, pairs: each batch as it is."""
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    ids = torch.arange(8).view(2, 4) * mask
    right = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1])}
    assert [b["input_ids"].shape for b in cut_by_length([right])] == [(1, 1), (1, 4)]  # it can be cut
    kept = [
        dict(right, attention_mask=mask.flip(1), input_ids=ids.flip(1)),
        dict(right, labels=torch.rand(2, 4)),
        dict(right, labels=torch.ones(2, 4, dtype=torch.long)),
        dict(right, note="text"),
        {"input_ids": ids, "labels": torch.tensor([0, 1])},
        (ids, torch.tensor([0, 1])),
    ]
    for batch in kept:
        assert cut_by_length([batch])[0] is batch


def test_a_model_with_tuple_outputs_is_calibrated_as_with_dict_outputs(tmp_path) -> None:
    """A ``return_dict=False`` model returns its logits first in a tuple: the check of a
    ``calibration_dataset`` before training and ``calibrate()`` raised 'the model output has no
    logits'. Both now score the tuple's logits: the same calibration as the model's dict outputs."""
    model = tiny_bert()
    model.config.return_dict = False
    held_out = ragged_classification(40, seed=2)
    trainer = EVONTrainer(
        model=model,
        args=config(tmp_path, max_steps=6, per_device_eval_batch_size=8),
        train_dataset=ragged_classification(48, seed=0),
        calibration_dataset=held_out,
        data_collator=pad,
    )
    trainer.train()
    kwargs = dict(grid=(1.0, 0.3, 0.1), num_samples=3, always_scan=True, screen_factor=0.0)
    results = [trainer.calibration, trainer.calibrate(**kwargs)]
    model.config.return_dict = True
    expected = [trainer.calibrate(), trainer.calibrate(**kwargs)]
    assert len(results[1].nll) == 3
    for result, reference in zip(results, expected, strict=True):
        assert result.grid == reference.grid and result.nll == reference.nll
        assert result.mean_nll == reference.mean_nll and result.temperature == reference.temperature
        assert result.ess == reference.ess


CALIBRATION_DDP_WORKER = """
import os, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
from test_trainer import classification_data, config, tiny_bert
from hf_evon import EVONTrainer

out = Path(sys.argv[2])
args = config(out, max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4, ddp_backend="gloo",
              bma_num_samples=2, evon_ess=300.0)
trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(48),
                      calibration_dataset=classification_data(31, 7))
trainer.train()
torch.save({"calibration": vars(trainer.calibration), "posterior": trainer.current_posterior().to_tensors()},
           out / f"rank{os.environ['RANK']}.pt")
torch.distributed.barrier()
from launcher import finish  # ends the worker before gloo's destructors can abort or hang it
finish()
"""


def test_calibration_at_the_end_of_training_under_ddp_scores_the_whole_split_alike_on_every_rank(tmp_path) -> None:
    """Two gloo ranks, 31 calibration examples: each rank scored only its own half of the split (16
    targets, one of them the padding duplicate) and chose its own temperature and scale (4.76 on
    one rank, 8.0 on the other), so the ranks' posteriors differed and rank 0's was saved. Every
    rank now scores the whole split, each example once, and makes one choice."""
    from pathlib import Path

    from launcher import torchrun

    worker = tmp_path / "worker.py"
    worker.write_text(CALIBRATION_DDP_WORKER)
    torchrun(2, str(worker), str(Path(__file__).parent), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["calibration"]["num_targets"] == 31  # one label per example, each example once
    assert ranks[0]["calibration"] == ranks[1]["calibration"]
    assert all(torch.equal(ranks[0]["posterior"][k], ranks[1]["posterior"][k]) for k in ranks[0]["posterior"])


CALIBRATION_ITERABLE_DDP_WORKER = """
import os, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
from test_calibration_data import pad, ragged_classification
from test_trainer import classification_data, classification_rows, config, tiny_bert
from hf_evon import EVONTrainer

class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(classification_rows(31, 7))

out = Path(sys.argv[2])
args = config(out, max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=4, ddp_backend="gloo",
              bma_num_samples=2, evon_ess=300.0)
# accelerate dispatches an iterable split: rank 0 reads (and concatenates batches: of one width only), each
# rank gets a slice of each batch
ragged = ragged_classification(31, 2).to_iterable_dataset()
trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(48), data_collator=pad,
                      calibration_dataset=ragged)
trainer.train()
kwargs = dict(grid=(1.0, 0.3), num_samples=2, always_scan=True, screen_factor=0.0)
results = {"at the end": trainer.calibration, "dispatched": trainer.calibrate(Stream(), **kwargs),
           "map-style": trainer.calibrate(classification_data(31, 7), **kwargs)}
trainer.accelerator.dataloader_config.dispatch_batches = False  # each rank reads its own shard
results["IterableDatasetShard"] = trainer.calibrate(Stream(), **kwargs)
results["datasets shards"] = trainer.calibrate(classification_data(31, 7).to_iterable_dataset(num_shards=2), **kwargs)
trainer.accelerator.dataloader_config.dispatch_batches = True  # a map-style split's batches dispatched too
results["map-style dispatched"] = trainer.calibrate(classification_data(31, 7), **kwargs)
torch.save({k: vars(v) for k, v in results.items()}, out / f"rank{os.environ['RANK']}.pt")
torch.distributed.barrier()
from launcher import finish  # ends the worker before gloo's destructors can abort or hang it
finish()
"""


def test_an_iterable_calibration_split_under_ddp_is_scored_whole_alike_on_every_rank(tmp_path) -> None:
    """Two gloo ranks, an ``IterableDataset`` of 31 calibration examples: accelerate splits it however it
    reads it (batches dispatched from rank 0, ``IterableDatasetShard``, a ``datasets`` stream's own
    shards), so each rank scored 15 or 16 targets and chose its own temperature (4.76 on one rank, 1.0
    on the other); so did a map-style split with ``dispatch_batches=True``. Every rank now scores the whole
    split, as the map-style split is scored by default. The check of the split before training read it as
    dispatched too: batches of different widths (a padding collator's) failed before the first step, on
    rank 0 alone, in accelerate's concatenation ("You can't use batches of different size with
    `dispatch_batches=True`"), rank 1 waiting for its broadcast; every rank now checks the whole split."""
    from pathlib import Path

    from launcher import torchrun

    worker = tmp_path / "worker.py"
    worker.write_text(CALIBRATION_ITERABLE_DDP_WORKER)
    torchrun(2, str(worker), str(Path(__file__).parent), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert ranks[0]["at the end"]["num_targets"] == 31
    reference = ranks[0]["map-style"]
    assert reference["num_targets"] == 31
    for name in ("dispatched", "IterableDatasetShard", "datasets shards", "map-style dispatched"):
        assert ranks[0][name] == reference, name


def test_forward_inputs_reads_a_forwards_signature_once_per_model_and_forward(monkeypatch) -> None:
    """The BMA passes and the calibration call ``forward_inputs`` for every batch of every pass; it
    read ``inspect.signature`` of the model's forward each time (S passes × batches reads). Once per
    model and forward now (again for another one, or a forward replaced on the instance), with the
    same batches."""
    import inspect

    from hf_evon.trainer import calibration_data

    class Net(torch.nn.Module):
        def forward(self, input_ids, labels=None):  # noqa: ANN001, ANN201
            return input_ids

    reads = []
    signature = inspect.signature

    def counted(obj, *args, **kwargs):  # noqa: ANN001, ANN202
        reads.append(getattr(obj, "__func__", obj))
        return signature(obj, *args, **kwargs)

    monkeypatch.setattr(calibration_data.inspect, "signature", counted)
    batch = {"input_ids": torch.ones(2, 3), "labels": torch.zeros(2), "weight": torch.ones(2)}
    model, other = Net(), Net()
    for _ in range(5):
        assert list(calibration_data.forward_inputs(model, batch)) == ["input_ids", "labels"]
        assert list(calibration_data.forward_inputs(model, batch, ["weight"])) == ["input_ids", "labels", "weight"]
    assert reads == [Net.forward]
    assert list(calibration_data.forward_inputs(other, batch)) == ["input_ids", "labels"]
    assert reads == [Net.forward, Net.forward]

    def any_entry(**kwargs):  # noqa: ANN003, ANN202
        return kwargs

    model.forward = any_entry  # an instance's own forward, taking every entry
    assert calibration_data.forward_inputs(model, batch) is batch
    assert calibration_data.forward_inputs(model, batch) is batch
    assert reads == [Net.forward, Net.forward, any_entry]
    # the BMA passes' scoring_inputs (labels left out where the forward takes them as optional) too
    third = Net()
    for _ in range(5):
        inputs, labelled = calibration_data.scoring_inputs(third, batch, ["labels"])
        assert list(inputs) == ["input_ids"] and not labelled
    assert reads == [Net.forward, Net.forward, any_entry, Net.forward]


def test_a_calibration_dataset_leaves_the_training_as_it_is_without_one(tmp_path, monkeypatch) -> None:
    """The check of calibration_dataset before the first step reads its batches, and a loader draws
    its workers' seed from torch's generator at each read: training with dropout then drew other
    masks than without a calibration_dataset, and ended at other weights (by up to 5.5e-3)."""
    monkeypatch.setattr(EVONTrainer, "calibrate", lambda self, *args, **kwargs: None)  # the weights alone
    weights = []
    for calibration in (None, ragged_classification(12, seed=2)):
        trainer = EVONTrainer(
            model=tiny_bert(dropout=0.1),
            args=config(tmp_path / str(calibration is None), max_steps=3),
            train_dataset=ragged_classification(48, seed=0),
            data_collator=pad,
            calibration_dataset=calibration,
        )
        trainer.train()
        weights.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    assert torch.equal(weights[0], weights[1])


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_plain_function_collator_that_pads_on_the_left_keeps_the_datasets_order(side: str) -> None:
    """Left padding moves a row's tokens' positions, so sorting by length changes what the BMA passes
    score: a collator that pads on the left keeps the dataset's order. It was told by a ``padding_side``
    on the collator or its tokenizer only, and a plain function (``lambda f: tok.pad(f, ...)``) was
    sorted: at zero variance eval_bma_nll 1.116 against the mean's 1.131, and the calibration chose
    T 0.841 where the dataset's order gives 0.707. Its first batch tells; torch's generator as it was."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, 20)}}, unk_token="[UNK]"))
    words.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]", unk_token="[UNK]", padding_side=side)
    rows = [{"input_ids": list(range(2, 2 + n)), "attention_mask": [1] * n} for n in (5, 2, 7, 3)]
    data = Dataset.from_list(rows)

    def collate(features):  # noqa: ANN001, ANN202
        return tok.pad(features, return_tensors="pt")

    state = torch.get_rng_state()
    ordered = length_sorted(data, collate)
    assert torch.equal(torch.get_rng_state(), state)
    if side == "left":
        assert ordered is data
    else:
        assert [len(r) for r in ordered["input_ids"]] == [2, 3, 5, 7]


def test_a_masking_collator_with_its_own_seed_draws_the_same_masks_for_training_whatever_evon_reads() -> None:
    """``DataCollatorForLanguageModeling(mlm=True, seed=42)`` draws its masks from its own generator,
    which the BMA passes' replay and the pre-training check of ``calibration_dataset`` did not save: the
    BMA passes scored other masks than the Trainer's pass, and training itself changed with
    ``bma_eval_every`` (weights 3.9e-3 apart) and with a calibration split given (1.0e-2 apart). The
    collator's draws are kept: the final weights are bit-identical across the three runs."""
    import tempfile
    from pathlib import Path

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        PreTrainedTokenizerFast,
    )

    vocab = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, **{f"w{i}": i for i in range(3, 100)}}
    words = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]", mask_token="[MASK]", unk_token="[UNK]")

    def rows(n: int, seed: int) -> Dataset:
        g = torch.Generator().manual_seed(seed)
        lengths = [4 + int(torch.randint(0, 10, (1,), generator=g)) for _ in range(n)]
        return Dataset.from_list([{"input_ids": torch.randint(3, 100, (k,), generator=g).tolist()} for k in lengths])

    def run(every: int, calibration: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        ))  # fmt: skip
        collator = DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.3, seed=42)
        with tempfile.TemporaryDirectory() as out:
            args = config(Path(out), max_steps=4, evon_ess=60.0, bma_num_samples=2, per_device_eval_batch_size=4,
                          eval_strategy="steps", eval_steps=2, bma_eval_every=every)  # fmt: skip
            trainer = EVONTrainer(
                model=model, args=args, train_dataset=rows(24, 0), eval_dataset=rows(9, 1), data_collator=collator,
                calibration_dataset=rows(9, 2) if calibration else None,
            )
            trainer.calibrate = lambda *a, **k: None  # the weights at the end of training only
            trainer.train()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    plain = run(0, False)
    for other in (run(1, False), run(0, True)):
        assert all(torch.equal(other[k], plain[k]) for k in plain)
