"""Sharded EVON under FSDP2 (``fully_shard``) on 1, 2 and 3 CPU processes (gloo).

``tests/fsdp2_worker.py`` trains a tiny float64 model whose matrices (7 and 11 rows) split
unevenly over the ranks, each layer and the root ``fully_shard``-ed; world 1 also trains the
reference: the same model without FSDP2, one process, ``prepare_distributed(shard=True)``
(the noise semantics sharded runs share: one sample, one stream per matrix), whole batch.
The checks recompute what they compare from shapes and files.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import fsdp2_worker as worker
import pytest
import torch
from conftest import approx_tree, refuse_lookups
from launcher import runs_per_world, scenario_results

from hf_evon import EVONPosterior, build_optimizer
from hf_evon.distributed.fsdp2 import shard_rows

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fsdp2_worker.py")
TRAINER_WORKER = os.path.join(HERE, "fsdp2_trainer_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, two_ranks) -> dict[int, tuple[str, list[dict]]]:
    """``{world: (its output directory, what each rank saved)}``: world 2 in the launch of ``two_ranks``."""
    out = runs_per_world(tmp_path_factory, WORKER, "fsdp2_world", worlds=(1, 3))
    out[2] = two_ranks[0], two_ranks[1]("trained")
    return out


@pytest.fixture(scope="module")
def ref(runs) -> dict:
    return runs[1][1][0]["reference"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Callable[[str], list[dict]]]:
    """Every scenario of ``tests/fsdp2_edge_worker.py``, in one 2-rank launch (its start is most of a
    scenario's cost): the output directory and ``load(scenario)``, what each rank saved for it."""
    import fsdp2_edge_worker as ew

    out = str(tmp_path_factory.mktemp("fsdp2_two_ranks"))
    return out, scenario_results(2, os.path.join(HERE, "fsdp2_edge_worker.py"), out, list(ew.SCENARIOS))


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-300)) for k in a)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_step_and_sample_equal_the_single_process_run(runs, ref, world: int) -> None:
    assert len(ref["trace"]) == worker.STEPS and len(ref["samples"]) == worker.STEPS
    assert max(ref["norms"]) > worker.MAX_NORM  # the clipping between samples and step binds
    for r in runs[world][1]:
        run = r["fsdp2"]
        assert len(run["trace"]) == worker.STEPS and len(run["samples"]) == worker.STEPS
        for a, b in zip(ref["samples"], run["samples"]):  # each step's first sample, full weights
            assert _max_rel(a, b) <= 1e-6
        for a, b in zip(ref["trace"], run["trace"]):
            assert _max_rel(a, b) <= 1e-6
    # the comparison is of moved values: the noise perturbs, the steps train
    assert _max_rel(ref["samples"][-1], ref["trace"][-2]) > 1e-3
    assert _max_rel(ref["trace"][-1], worker.net().state_dict()) > 1e-3


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_sample_per_step_with_and_without_clipping_equals_the_single_process_run(
    runs, ref, world
) -> None:
    assert len(ref["single"]) == worker.STEPS
    for r in runs[world][1]:
        for a, b in zip(ref["single"], r["fsdp2"]["single"], strict=True):
            assert _max_rel(a, b) <= 1e-6
    assert _max_rel(ref["single"][-1], ref["trace"][-1]) > 1e-3  # another run than the 2-sample one


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_see_bitwise_identical_weights(runs, world: int) -> None:
    ranks = [r["fsdp2"] for r in runs[world][1]]
    for r in ranks[1:]:
        for key in ("trace", "samples"):
            for a, b in zip(ranks[0][key], r[key]):
                assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_from_the_gathered_state_dict_is_bit_for_bit(runs, world: int) -> None:
    for r in runs[world][1]:
        run = r["fsdp2"]
        final = run["trace"][-1]
        assert all(torch.equal(final[k], run["resumed"][k]) for k in final)
        a, b = run["full_state"]["state"], run["resumed_state"]["state"]
        assert a.keys() == b.keys() and len(a) == 11
        for i in a:
            assert all(torch.equal(a[i][k], b[i][k]) for k in a[i])


@pytest.mark.parametrize("world", [2, 3])
def test_gathered_state_dict_is_the_single_process_one(runs, ref, world: int) -> None:
    want = ref["full_state"]
    for r in runs[world][1]:
        sd = r["fsdp2"]["full_state"]
        assert sd["param_groups"] == approx_tree(want["param_groups"])
        assert sd["evon"] == want["evon"]
        assert sd["state"].keys() == want["state"].keys()
        for i, st in want["state"].items():  # AdamW rows gathered to whole tensors too
            assert st.keys() == sd["state"][i].keys()
            for k, v in st.items():
                assert sd["state"][i][k].shape == v.shape
                torch.testing.assert_close(sd["state"][i][k], v, rtol=1e-6, atol=1e-12)


def _optimizer_order() -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) in the optimizer's order; EVON trains the ``layers.*.weight``."""
    model = worker.net()
    name_of = {id(p): n for n, p in model.named_parameters()}
    opt = build_optimizer(model, adamw_patterns=[r"^emb\."], **worker.HP)
    return [(name_of[id(p)], p) for g in opt.param_groups for p in g["params"]]


def _is_evon(name: str) -> bool:
    return name.startswith("layers.") and name.endswith("weight")


def _expected_state_bytes(world: int, rank: int, owned: list[bool]) -> int:
    """From shapes alone: a 7x7 float64 EVON matrix holds hess, exp_avg, L, R, Q_L, Q_R, two
    numbers (exp_avg_sq_norm, noise_watched) and its float32 update count; AdamW tensors (the embedding, every bias) hold
    exp_avg and exp_avg_sq of this rank's rows only, and a float32 step."""
    total = 0
    for (name, p), mine in zip(_optimizer_order(), owned, strict=True):
        if _is_evon(name):
            if mine:
                total += 6 * p.numel() * 8 + 2 * 8 + 4
        else:
            assert mine  # every rank owns its rows of every AdamW tensor
            rows = shard_rows(p.shape[0], world, rank)[1]
            total += 2 * rows * (p.numel() // p.shape[0]) * 8 + 4
    return total


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_rank_holds_only_its_share_of_the_state(runs, ref, world: int) -> None:
    total = ref["state_bytes"]
    assert total == _expected_state_bytes(1, 0, [True] * 11)
    ranks = [r["fsdp2"] for r in runs[world][1]]
    for i, (name, _) in enumerate(_optimizer_order()):
        owners = sum(r["owned"][i] for r in ranks)
        assert owners == (1 if _is_evon(name) else world)  # one owner per matrix; AdamW: rows
    for rank, r in enumerate(ranks):
        assert r["state_bytes"] == _expected_state_bytes(world, rank, r["owned"])
        assert r["state_bytes"] <= 1.2 * total / world


@pytest.mark.parametrize("world", [2, 3])
def test_posterior_equals_the_single_process_one(runs, ref, world: int) -> None:
    a = EVONPosterior.from_pretrained(os.path.join(runs[1][0], "posterior_reference"))
    b = EVONPosterior.from_pretrained(os.path.join(runs[world][0], "posterior_fsdp2"))  # loads in one process
    drop = {"checkpoint_id"}
    assert {k: v for k, v in b.config.items() if k not in drop} == approx_tree(
        {k: v for k, v in a.config.items() if k not in drop}
    )
    ta, tb = a.to_tensors(), b.to_tensors()
    assert ta.keys() == tb.keys() and len(ta) > 0
    for k in ta:
        torch.testing.assert_close(tb[k], ta[k], rtol=1e-6, atol=1e-12)
    model_a, model_b = worker.net(), worker.net()
    with a.sampled(model_a, seed=3), b.sampled(model_b, seed=3):  # the same draws from the same seed
        for (n, pa), (_, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
            torch.testing.assert_close(pb, pa, rtol=1e-6, atol=1e-12, msg=n)
    for r in runs[world][1]:  # posterior_std answers on every rank, for every matrix
        assert r["fsdp2"]["std"].keys() == ref["std"].keys() == {"layers.0.weight"}
        assert _max_rel(ref["std"], r["fsdp2"]["std"]) <= 1e-6


@pytest.mark.parametrize("world", [2, 3])
def test_health_statistics_pool_every_ranks_share(runs, ref, world: int) -> None:
    assert ref["health"] and "noise_to_signal" in ref["health"]
    for r in runs[world][1]:
        h = r["fsdp2"]["health"]
        assert h.keys() == ref["health"].keys()
        for k, v in ref["health"].items():
            assert h[k] == pytest.approx(v, rel=1e-6, abs=1e-12), k


@pytest.mark.parametrize("world", [2, 3])
def test_an_fsdp2_checkpoint_resumes_in_one_process_without_fsdp(runs, ref, world: int) -> None:
    ckpt = torch.load(os.path.join(runs[world][0], "checkpoint_fsdp2.pt"), weights_only=True)
    model, opt = worker.make(None)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optim"])
    worker.train(model, opt, worker.RESUME_AT, worker.STEPS, 0, 1)
    assert _max_rel(ref["trace"][-1], dict(model.named_parameters())) <= 1e-6


def test_bad_setups_are_refused_naming_the_parameter(runs) -> None:
    for r in runs[2][1]:
        assert "refusals_crash" not in r, r.get("refusals_crash")
        e = r["refusals"]
        unsupported = "UnsupportedParallelismError: "
        assert e["dim1"].startswith(unsupported) and "'0.weight'" in e["dim1"] and "Shard(0)" in e["dim1"]
        assert "Shard(dim=1)" in e["dim1"]
        assert (
            e["hsdp"].startswith(unsupported)
            and "1-D device mesh" in e["hsdp"]
            and "'emb.weight'" in e["hsdp"]
        )
        assert e["mixed"].startswith(unsupported) and "one device mesh" in e["mixed"]
        assert "'layers.2.weight'" in e["mixed"]
        assert e["partly"].startswith(unsupported) and "'emb.weight' is a plain tensor" in e["partly"]
        assert e["unsharded_mode"].startswith(unsupported) and "shard=True" in e["unsharded_mode"]
        assert "parameter 'emb.weight'" in e["unsharded_mode"]
        assert e["not_prepared"].startswith("RuntimeError") and "prepare_distributed" in e["not_prepared"]
        assert "layers.0.weight" in e["not_prepared"]
        assert e["fsdp1"].startswith(unsupported) and "FSDP1" in e["fsdp1"] and "fully_shard" in e["fsdp1"]


def test_trainer_fsdp_arguments_on_cpu_are_refused_not_silently_ddp(two_ranks) -> None:
    """accelerate enables its FSDP plugin on GPUs/accelerators only: on 2 CPU processes the
    Trainer's fsdp arguments would give plain DDP; EVONTrainer says so before any step."""
    for r in two_ranks[1]("trainer_refused"):
        msg = r["message"]
        assert msg.startswith("UnsupportedParallelismError: ") and "accelerate did not enable FSDP" in msg
        assert "MULTI_CPU" in msg and "fully_shard" in msg


@pytest.fixture(scope="module")
def trainer_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[int, tuple[str, Callable[[str], list[dict]]]]:
    """``tests/fsdp2_trainer_worker.py``'s modes: ``fsdp2`` and ``held`` (under accelerate's FSDP switch)
    in one 2-rank launch, ``reference`` in one process. ``{world: (its output directory, load(mode))}``."""
    out = {}
    for world, modes in ((2, ["fsdp2", "held"]), (1, ["reference"])):
        d = str(tmp_path_factory.mktemp(f"fsdp2_trainer{world}"))
        out[world] = d, scenario_results(world, TRAINER_WORKER, d, modes)
    return out


def test_trainer_fsdp2_arguments_equal_the_single_process_run(trainer_runs) -> None:
    """The Trainer's own FSDP2 path (``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2}``)
    on 2 CPU processes, accelerate's GPU-only FSDP switch turned on in the worker: the same
    weights and posterior as one process with ``evon_shard=True`` on the same global batch."""
    import fsdp2_trainer_worker as tw

    (ref_dir, load_ref), (fsdp_dir, load_fsdp2) = trainer_runs[1], trainer_runs[2]
    (ref,), ranks = load_ref("reference"), load_fsdp2("fsdp2")
    assert ref["sharding"] == "EVONSharding" and ref["dtensor_params"] == 0 and not ref["is_fsdp2"]
    init = {n: p.detach() for n, p in tw.base.Regressor().named_parameters()}
    assert _max_rel(ref["weights"], init) > 1e-3  # trained: the comparison is of moved weights
    norms = [e["grad_norm"] for e in ref["log"] if "grad_norm" in e]
    assert len(norms) == tw.STEPS and max(norms) > tw.MAX_NORM  # the clipping binds
    for r in ranks:  # really FSDP2 through accelerate and the Trainer, not DDP
        assert r["distributed_type"] == "DistributedType.FSDP" and r["is_fsdp2"]
        assert r["fsdp_modules"] == sorted(["", *(f"net.{i}" for i in range(0, 15, 2))])
        assert r["fsdp2_sharding"] and r["dtensor_params"] == len(init)
        assert r["steps"] == tw.STEPS and r["skipped"] == 0
        # a fresh 2-process run resumed from checkpoint-2 ends bit-for-bit where this one did
        assert r["resume"] == f"resumed to step {tw.STEPS}", r["resume"]
        assert all(torch.equal(r["weights"][k], r["resumed_weights"][k]) for k in init)
        assert r["resumed_skipped"] == 0
        resumed = [e["grad_norm"] for e in r["resumed_log"] if "grad_norm" in e]  # 2 restored, 1 new
        assert resumed == [e["grad_norm"] for e in r["log"] if "grad_norm" in e]
        assert _max_rel(ref["weights"], r["weights"]) <= 1e-6
        assert all(torch.equal(ranks[0]["weights"][k], r["weights"][k]) for k in init)
        got = [e["grad_norm"] for e in r["log"] if "grad_norm" in e]
        assert got == pytest.approx(norms, rel=1e-6)
        # a save into a directory whose posterior config's name is a directory: every rank refused it before
        # the weights were gathered and written (rank 0 wrote them, then its posterior's save refused)
        refused = os.path.join(fsdp_dir, "refused", "evon_posterior_config.json")
        assert r["refused"] == (
            f"{refused}: a directory, where a posterior save writes its config; refusing to save over it "
            "(remove it, or save elsewhere)",
            ["evon_posterior_config.json"],
        ), r["refused"]
    # save_model: the weights the Trainer gathered, and the posterior, loaded in one process
    from safetensors.torch import load_file

    saved = load_file(os.path.join(fsdp_dir, "saved", "model.safetensors"))
    assert _max_rel(ref["weights"], saved) <= 1e-6
    drop = {"checkpoint_id"}
    for where in ("run/checkpoint-2", "saved"):  # mid-run checkpoint, and save_model
        a = EVONPosterior.from_pretrained(os.path.join(ref_dir, where))
        b = EVONPosterior.from_pretrained(os.path.join(fsdp_dir, where))
        assert {k: v for k, v in b.config.items() if k not in drop} == approx_tree(
            {k: v for k, v in a.config.items() if k not in drop}
        )
        ta, tb = a.to_tensors(), b.to_tensors()
        assert ta.keys() == tb.keys() and len(ta) > 0
        assert _max_rel(ta, tb) <= 1e-6  # per tensor (an eigenbasis' near-zero entries differ more)
    # the Trainer's FSDP checkpoint holds the optimizer state gathered to whole tensors, by name:
    # the reference checkpoint's (unsharded, by index), without EVON's own entry (seed, streams)
    optim = torch.load(os.path.join(fsdp_dir, "run", "checkpoint-2", "optimizer.bin"), weights_only=True)
    want = torch.load(os.path.join(ref_dir, "run", "checkpoint-2", "optimizer.pt"), weights_only=True)
    assert optim["state"].keys() == init.keys() and "evon" in want and "evon" not in optim
    names = [n for g in optim["param_groups"] for n in g["param_names"]]
    ids = [i for g in want["param_groups"] for i in g["params"]]
    assert len(names) == len(ids) == len(init) and len(want["state"]) == len(init)
    assert sum("Q_L" in optim["state"][n] for n in names) == 8  # every weight: EVON; biases: AdamW
    for name, i in zip(names, ids, strict=True):
        assert optim["state"][name].keys() == want["state"][i].keys()
        assert _max_rel(want["state"][i], optim["state"][name]) <= 1e-6
    model_a, model_b = tw.base.Regressor(), tw.base.Regressor()
    with a.sampled(model_a, seed=3), b.sampled(model_b, seed=3):  # the same draws from the same seed
        wa = {n: p.detach().clone() for n, p in model_a.named_parameters()}
        wb = {n: p.detach().clone() for n, p in model_b.named_parameters()}
        assert _max_rel(wa, wb) <= 1e-6 and _max_rel(wa, init) > 1e-6


def test_a_given_posterior_is_dropped_on_every_rank_once_fsdp2_training_moved_the_weights(
    trainer_runs,
) -> None:
    """``posterior=`` with another optimizer under the Trainer's FSDP2: only rank 0 holds the leading
    values its ``mean_fingerprint`` is compared with, so after training rank 0 dropped the posterior and
    rank 1 kept it (its BMA passes would then wait on collectives rank 0 never joins)."""
    ranks = trainer_runs[2][1]("held")
    assert all(r["dtensor_params"] > 0 for r in ranks)  # the model is sharded
    assert [r["before"] for r in ranks] == [True, True]  # the weights it was taken at
    assert [r["after"] for r in ranks] == [None, None]  # AdamW moved them: no rank keeps it
    # nor does any rank refuse a save into a directory that holds a directory under the posterior config's name:
    # no posterior is saved (a rank refusing alone would leave the others waiting in the weights' gathering)
    for r in ranks:
        assert r["unrefused"][0] is None and "model.safetensors" in r["unrefused"][1], r["unrefused"]


@pytest.mark.parametrize("world", [2, 3])
def test_a_nonfinite_gradient_row_skips_the_step_on_every_rank(runs, world: int) -> None:
    for rank, r in enumerate(runs[world][1]):
        nf = r["nonfinite"]
        assert nf["skipped"] == 1 and nf["unchanged"]
        assert len(nf["messages"]) == 1 and "the step was skipped" in nf["messages"][0]
        # every rank names the matrix, as non-finite: its owner, which holds the NaN in its full copy of the
        # gradient, called it "finite but so large (a spike) that its square is not"
        assert nf["messages"][0].startswith("non-finite gradient in layers.3.weight"), (rank, nf["messages"])


def test_a_block_that_raised_on_one_rank_is_recorded_on_no_rank(two_ranks) -> None:
    """Rank 1's second block raised after its backward (and was caught): before the fix rank 0 sent
    that block's gradients to the owners alone (an all_to_all) while rank 1 went on into the step's
    all-reduce, and the job hung (the timeout fails it). Now rank 0's block raises naming rank 1,
    neither records it, and the step equals that of a run of the first block alone."""
    results = two_ranks[1]("block_raised")
    raised = [r["raised"] for r in results]
    assert "raised on rank 1, so this block is recorded on no rank" in raised[0]["block_error"]
    assert raised[1]["block_error"] == "a failed logging callback"
    assert [r["samples"] for r in raised] == [1, 1] and [r["message"] for r in raised] == ["", ""]
    for r in results:
        alone = r["alone"]
        assert alone["samples"] == 1 and alone["block_error"] == ""
        for k, v in alone["weights"].items():
            assert torch.equal(r["raised"]["weights"][k], v), k


def test_trainer_refuses_an_fsdp2_checkpoint_without_evon_optimizer_state(tmp_path) -> None:
    """Under FSDP2 EVON's state is resumed from ``evon_optimizer.pt`` (the Trainer's optimizer.bin,
    torch's distributed checkpoint, does not fit it): a checkpoint without it is refused by name
    (the sharding object stands in for a real FSDP2 one)."""
    from datasets import Dataset

    from hf_evon import EVONConfig, EVONTrainer
    from hf_evon.distributed.ddp import UnsupportedParallelismError
    from hf_evon.distributed.fsdp2 import FSDP2Sharding

    model = torch.nn.Linear(4, 4)
    args = EVONConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=1)
    data = Dataset.from_dict({"x": [[0.0] * 4]})
    trainer = EVONTrainer(model=model, args=args, train_dataset=data)
    trainer.create_optimizer()
    trainer.evon_optimizer.sharding = object.__new__(FSDP2Sharding)
    with pytest.raises(UnsupportedParallelismError, match="has no evon_optimizer.pt"):
        trainer._load_optimizer_and_scheduler(str(tmp_path))
    trainer.evon_optimizer.sharding = None  # not FSDP2: the Trainer's own (nothing to load here)
    trainer._load_optimizer_and_scheduler(None)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("evon_optimizer.pt", "EACCES"),
        ("evon_optimizer.pt", "loop"),
        ("scheduler.pt", "EACCES"),
        ("scheduler.pt", "dangling link"),
    ],
)
def test_an_fsdp2_checkpoints_state_file_listed_there_is_not_taken_for_none(tmp_path, name, kind) -> None:
    """An FSDP2 checkpoint's ``evon_optimizer.pt`` or ``scheduler.pt`` that this user cannot look up (EACCES;
    simulated, the tests run as root), that is a loop of links or a link to nothing: os.path.isfile took it
    for none, so the checkpoint was said to have no evon_optimizer.pt, and a scheduler.pt so listed was
    skipped: the run resumed with a fresh learning-rate schedule. The PermissionError naming the file is
    raised, and a link that reaches nothing is named as such (the sharding object stands in for a real
    FSDP2 one)."""
    from datasets import Dataset

    from hf_evon import EVONConfig, EVONTrainer
    from hf_evon.distributed.fsdp2 import FSDP2Sharding

    model = torch.nn.Linear(4, 4)
    args = EVONConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, max_steps=1)
    trainer = EVONTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"x": [[0.0] * 4]}))
    trainer.create_optimizer()
    trainer.evon_optimizer.sharding = object.__new__(FSDP2Sharding)
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    (checkpoint / "evon_optimizer.pt").write_bytes(b"")  # read once EVON is sharded, not here
    path = checkpoint / name
    if kind == "EACCES":
        path.write_bytes(b"")
        with pytest.MonkeyPatch.context() as patch:
            refuse_lookups(patch, lambda p: p == str(path))
            with pytest.raises(PermissionError) as err:
                trainer._load_optimizer_and_scheduler(str(checkpoint))
        assert err.value.filename == str(path)
        return
    path.unlink(missing_ok=True)
    target = path if kind == "loop" else tmp_path / "moved-away"
    path.symlink_to(target)
    with pytest.raises(FileNotFoundError) as err:
        trainer._load_optimizer_and_scheduler(str(checkpoint))
    why = "leads into a loop of links (ELOOP)" if kind == "loop" else "does not exist"
    assert str(err.value) == (
        f"EVONTrainer cannot resume this FSDP2 run: {str(path)!r} is a link to {str(target)!r}, which {why}"
    ), str(err.value)


@pytest.mark.parametrize("content", ["truncated", "code", "another model"])
def test_an_unreadable_evon_optimizer_state_is_named_by_its_file(tmp_path, content) -> None:
    """A resume from an ``evon_optimizer.pt`` cut short, holding a pickle that would run code, or
    holding another model's state raised torch's "PytorchStreamReader failed reading zip archive",
    its "Weights only load failed" or EVON's load_state_dict error, none naming the file. Each is a
    ValueError naming it, and the optimizer is left as it was (the sharding object stands in for a
    real FSDP2 one)."""
    import pickle

    from datasets import Dataset

    from hf_evon import EVONConfig, EVONTrainer
    from hf_evon.distributed.fsdp2 import FSDP2Sharding

    model = torch.nn.Linear(4, 4)
    args = EVONConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, max_steps=1)
    trainer = EVONTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"x": [[0.0] * 4]}))
    trainer.create_optimizer()
    path = tmp_path / "evon_optimizer.pt"
    if content == "another model":
        other = torch.nn.Linear(4, 3)
        torch.save(type(trainer.evon_optimizer)(other.parameters()).state_dict(), path)
    else:
        torch.save(trainer.evon_optimizer.state_dict(), path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if content == "truncated" else pickle.dumps(os.getcwd))
    before = copy.deepcopy(trainer.evon_optimizer.state_dict())
    trainer.evon_optimizer.sharding = object.__new__(FSDP2Sharding)
    trainer._load_optimizer_and_scheduler(str(tmp_path))
    with pytest.raises(ValueError) as err:
        trainer._load_fsdp2_optimizer()
    assert str(err.value).startswith(f"{path}: "), str(err.value)
    trainer.evon_optimizer.sharding = None
    after = trainer.evon_optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"] and after["state"].keys() == before["state"].keys()


@pytest.mark.parametrize("content", ["code", "truncated"])
def test_a_refused_scheduler_state_is_named_by_its_file(tmp_path, content) -> None:
    """An FSDP2 resume from a ``scheduler.pt`` holding a pickle that would run code raised torch's
    "Weights only load failed", naming no file and advising ``weights_only=False``, which would run
    it; one cut short raised torch's "PytorchStreamReader failed reading zip archive", naming no file.
    Each is a ValueError naming the file (and the global the unpickler met), with no such advice."""
    from datasets import Dataset

    from hf_evon import EVONConfig, EVONTrainer
    from hf_evon.distributed.fsdp2 import FSDP2Sharding

    model = torch.nn.Linear(4, 4)
    args = EVONConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, max_steps=1)
    trainer = EVONTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"x": [[0.0] * 4]}))
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    torch.save(trainer.evon_optimizer.state_dict(), tmp_path / "evon_optimizer.pt")
    scheduler = tmp_path / "scheduler.pt"
    if content == "code":
        torch.save({"last_epoch": os.getcwd}, scheduler)
    else:
        torch.save(trainer.lr_scheduler.state_dict(), scheduler)
        scheduler.write_bytes(scheduler.read_bytes()[:100])
    trainer.evon_optimizer.sharding = object.__new__(FSDP2Sharding)
    with pytest.raises(ValueError) as err:
        trainer._load_optimizer_and_scheduler(str(tmp_path))
    text = str(err.value)
    assert text.startswith(f"{scheduler}: "), text
    if content == "code":
        assert f"{os.getcwd.__module__}.getcwd" in text, text
    assert "weights_only=False" not in text and "can still be loaded" not in text, text


def test_a_posterior_samples_into_an_fsdp2_model_and_restores_it(two_ranks) -> None:
    """``posterior.sampled(model)`` on DTensor parameters (the Trainer's BMA evaluation under FSDP2)
    raised torch's "aten.add.Tensor got mixed torch.Tensor and DTensor": the whole draw was added to
    the shard. Each rank now holds its rows of the same sample as the unsharded model's. Without a
    seed each rank took one from its own RNG, writing its rows of another sample: refused, naming
    ``seed``, before any weight is written."""
    import fsdp2_posterior_worker as pw

    ranks = two_ranks[1]("posterior_sampled")
    model = worker.net()
    mean = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pw.posterior().sampled(model, seed=pw.SEED):
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert any(not torch.equal(want[n], mean[n]) for n in want)
    for r in ranks:
        assert "error" not in r, r["error"]
        assert r["sample"].keys() == want.keys()
        assert all(torch.equal(r["sample"][n], want[n]) for n in want)  # the same float64 maths
        assert all(torch.equal(r["after"][n], mean[n]) for n in mean)  # restored bit for bit
        assert r["seed_none"] is not None and r["seed_none"].startswith("ValueError: sampled(model, seed=None)")
        assert "pass seed=<int>, the same on every rank" in r["seed_none"]
        assert all(torch.equal(r["after_seed_none"][n], mean[n]) for n in mean)


def test_a_posterior_sampled_into_an_fsdp2_model_holds_one_parameters_draw_at_a_time(two_ranks) -> None:
    """``posterior.sampled(model)`` on DTensor parameters drew every covered parameter's whole
    perturbation on every rank (one (5, 1, 7, 7) tensor for the five 7x7 matrices of one factor
    group, 245 values), to keep only its rows of each: a rank's peak was the unsharded model's. It
    now draws one parameter at a time, so no tensor it makes exceeds one covered matrix (m·n) or a
    basis of one (m², n²): 49 values here."""
    import fsdp2_posterior_worker as pw

    post = pw.posterior()
    bound = max(max(m * n, m * m, n * n) for m, n in (post[name].matrix_shape for name in post.names))
    assert bound == worker.DIM**2 and len(post.names) == worker.DEPTH
    for r in two_ranks[1]("posterior_sampled"):
        assert "error" not in r, r["error"]
        assert r["largest"] == bound  # one matrix's draw is made whole: the bound holds exactly


def test_batched_bma_on_an_fsdp2_model_equals_the_unsharded_model(two_ranks) -> None:
    """``bma_log_likelihood``, ``generate_bma`` and both ``BatchedSamples`` strategies on DTensor
    parameters, each rank on its own prompts: the setup added the whole draw to a rank's shard
    ("The size of tensor a (5) must match the size of tensor b (10)") or failed making its guard of
    a DTensor. Each rank now runs the unsharded model's samples, exactly; its mean untouched. A
    DTensor no FSDP2 forward gathers is refused by name. ``synced_gpus=True``, which
    ``Seq2SeqTrainer`` passes for an FSDP-managed model (so that a rank done first goes on gathering
    shards for the others), was refused ("generate_bma does not support 'synced_gpus'"); ranks that
    decode different numbers of tokens now finish with the unsharded model's tokens. A materialized
    sharded block added the whole ΔW (S·m·n values per covered matrix) to the gathered mean in every
    forward, each decoding step ("full_adds" {'in_all': 17, 'second_forward': 8} against the
    unsharded {'in_all': 9, 'second_forward': 0}); it now forms each sample once, as the unsharded
    path does. Under FSDP2's mixed precision (the weights gathered in float32 from float64 shards)
    the factored strategy multiplied float32 activations with the float64 samples ("expected m1 and
    m2 to have the same dtype"); both strategies now give the float32 model's samples, exactly."""
    import fsdp2_bma_worker as bw

    ranks = two_ranks[1]("bma")
    net = bw.model()
    mean = {n: p.detach().clone() for n, p in net.named_parameters()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' (a matmul's rounding may depend on the thread count)
    try:
        want = [bw.results(net, bw.posterior(bw.model()), bw.prompts(rank), rank, None) for rank in range(2)]
        # what FSDP2 gathers under MixedPrecisionPolicy(param_dtype=torch.float32): the float32 model
        want_mixed = [bw.logits(bw.model().float(), bw.posterior(bw.model()), bw.prompts(rank)) for rank in range(2)]
    finally:
        torch.set_num_threads(threads)
    assert want[0]["materialize_factored"] == [] and len(want[0]["factored_factored"]) == 8  # both ways
    assert [w["uneven"].shape[1] - 4 for w in want] == [1, 4]  # the 4-token prompts' new tokens
    assert not torch.equal(want[0]["materialize"][:2], want[0]["materialize"][2:4])  # samples differ
    # the unsharded path forms each covered name's S samples once (at entry), none in a forward; so
    # must the sharded one ("full_adds" compared below)
    assert want[0]["full_adds"] == {"in_all": len(bw.posterior(net).names), "second_forward": 0}
    for r, w, mixed in zip(ranks, want, want_mixed, strict=True):
        assert "error" not in r, r["error"]
        assert not isinstance(r["mixed_precision"], str), r["mixed_precision"]
        assert r["mixed_precision"].keys() == mixed.keys() == {"materialize", "factored"}
        assert all(m.dtype == torch.float32 and torch.equal(r["mixed_precision"][k], m) for k, m in mixed.items())
        assert r["not_gathered"].startswith("BatchedSamplesRefused: posterior parameter 'weight' ")
        assert "without FSDP2 gathering it" in r["not_gathered"]
        assert r.keys() - {"after", "not_gathered", "mixed_precision"} == w.keys()
        assert r["full_adds"] == w["full_adds"]
        for key, value in w.items():
            assert (value == r[key]) if isinstance(value, list | dict) else torch.equal(value, r[key]), key
        assert r["after"].keys() == mean.keys() and all(torch.equal(r["after"][n], mean[n]) for n in mean)


def test_evaluation_blocks_on_gathered_fsdp2_weights_see_their_own_sample(two_ranks) -> None:
    """Under ``reshard_after_forward=False`` (and for the root of a lone ``fully_shard(model)``, by
    default) a forward without backward leaves the weights gathered, and FSDP2 gathers again only
    after a reshard: the second ``sampled_params(train=False)`` block's forward ran on the first
    block's sample, and the next training forward on the last one (not its own sample), so the run
    drifted from the same run without evaluation. Each block now runs on the sample its shards
    hold (the unsharded model's output on those weights), and evaluation leaves training exact."""
    from torch.func import functional_call

    ranks = two_ranks[1]("reshard")
    plain = worker.net()
    for r in ranks:
        for variant in ("no_reshard", "root"):
            assert not isinstance(r[variant], str), r[variant]
            with_evals, without = r[variant][True], r[variant][False]
            assert len(with_evals["blocks"]) == 4 and not without["blocks"]
            outs = [b["out"] for b in with_evals["blocks"]]
            assert not torch.equal(outs[0], outs[1])  # two samples
            for b in with_evals["blocks"]:
                want = functional_call(plain, b["sample"], (b["ids"], b["x"]))
                torch.testing.assert_close(b["out"], want, rtol=1e-12, atol=0, msg=variant)
            for a, c in zip(with_evals["trace"], without["trace"], strict=True):
                assert all(torch.equal(a[k], c[k]) for k in a), variant


@pytest.fixture
def edge(two_ranks) -> tuple[str, list[dict]]:
    """The ``edge`` scenario of ``tests/fsdp2_edge_worker.py``: its output directory and what each rank
    saved."""
    return two_ranks[0], two_ranks[1]("edge")


def test_a_posterior_of_matrices_with_fewer_rows_than_ranks_records_its_mean_fingerprint(edge) -> None:
    """``b.weight`` (2x3) on 2 ranks leaves rank 0 three of the six values a fingerprint read, and the
    saved posterior recorded no ``mean_fingerprint`` (None), so a model with other weights loaded
    beside it went unnoticed. It records the values rank 0 holds (the first of the flattened
    weight), and they match the unsharded model with those weights, and not one with others."""
    import warnings

    import fsdp2_edge_worker as ew

    from hf_evon.posterior.fingerprint import FINGERPRINT_POSITIONS, PosteriorMeanWarning

    out, ranks = edge
    for r in ranks:
        assert not isinstance(r["tiny"], str), r["tiny"]
    weights, fingerprint = ranks[0]["tiny"]["weights"], ranks[0]["tiny"]["fingerprint"]
    post = EVONPosterior.from_pretrained(os.path.join(out, "tiny_posterior"))
    assert post.config["mean_fingerprint"] == fingerprint and fingerprint is not None
    assert sorted(fingerprint["values"]) == sorted(post.names) == ["a.weight", "b.weight", "c.weight"]
    for name, values in fingerprint["values"].items():
        rows, cols = weights[name].shape
        held = shard_rows(rows, 2, 0)[1] * cols  # rank 0's values: 6, 3 and 2
        assert values == weights[name].reshape(-1)[: min(FINGERPRINT_POSITIONS, held)].tolist(), name
    model = ew.tiny()
    model.load_state_dict(weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PosteriorMeanWarning)
        post.check_model(model)  # the weights it was taken at
    with torch.no_grad():
        model.b.weight[0, 2] += 1.0  # the last value rank 0 held
    with pytest.warns(PosteriorMeanWarning, match=r"\['b\.weight'\]"):
        post.check_model(model)


def test_mean_mismatches_says_which_ranks_cannot_tell_and_reads_column_shards(edge) -> None:
    """``mean_mismatches`` returned ``[]`` (a match) on the rank that holds none of the fingerprint's
    leading values (rank 1 under FSDP2), also for moved weights, and on every rank for a matrix
    sharded by columns (``Shard(1)``: a tensor-parallel row-wise layer), whose moved weights no rank
    warned of. Rank 1 now says None (cannot tell) for rows; the rank holding the first columns
    (rank 0) reads the leading values of the first row it holds, records them, and warns."""
    _, ranks = edge
    for r in ranks:
        assert not isinstance(r["verdicts"], str), r["verdicts"]
    first, other = ranks[0]["verdicts"], ranks[1]["verdicts"]
    assert (first["rows_same"], first["rows_moved"], first["rows_warned"]) == ([], ["b.weight"], True)
    assert (other["rows_same"], other["rows_moved"], other["rows_warned"]) == (None, None, False)
    assert first["cols_fingerprint"] == {"dtype": "float64", "values": {"w": [0.0, 1.0]}}
    assert other["cols_fingerprint"] is None
    assert (first["cols_same"], first["cols_moved"], first["cols_warned"]) == ([], ["w"], True)
    assert (other["cols_same"], other["cols_moved"], other["cols_warned"]) == (None, None, False)


def test_a_failed_evaluation_forward_under_reshard_after_forward_false_leaves_the_mean(edge) -> None:
    """An evaluation forward that raises (in ``layers.2``, its earlier layers gathered with the
    sample) inside ``EVON.sampled_params(train=False)`` or ``posterior.sampled(model, seed=...)``
    under ``reshard_after_forward=False``: the shards hold the mean, a forward after it runs on the
    mean (the unsharded model's output on it), and training goes on as without the failed pass."""
    from torch.func import functional_call

    plain = worker.net()
    for r in edge[1]:
        want = r["plain"]
        assert not isinstance(want, str), want
        for via in ("evon", "posterior"):
            got = r[via]
            assert not isinstance(got, str), f"{via}: {got}"
            assert got["raised"], via
            assert all(torch.equal(got["mean"][k], v) for k, v in want["trace"][0].items()), via
            mean_out = functional_call(plain, got["mean"], (got["ids"], got["x"]))
            torch.testing.assert_close(got["out"], mean_out, rtol=1e-12, atol=0, msg=via)
            for a, b in zip(got["trace"], want["trace"], strict=True):
                assert all(torch.equal(a[k], b[k]) for k in a), via


def test_sampled_without_seed_is_refused_while_fsdp2_weights_are_gathered(edge) -> None:
    """After a forward without backward under ``reshard_after_forward=False`` the model's parameters
    are FSDP2's gathered plain tensors, and ``posterior.sampled(model)`` without a seed was accepted:
    each rank drew from its own RNG. It is refused, naming ``seed``, as for sharded weights, and
    no weight is written."""
    mean = worker.net().state_dict()
    for r in edge[1]:
        got = r["seed_none"]
        assert not isinstance(got, str), got
        assert got["gathered"] == ["Parameter"]  # not DTensors: the weights were gathered
        assert got["error"] is not None and got["error"].startswith("ValueError: sampled(model, seed=None)")
        assert "pass seed=<int>, the same on every rank" in got["error"]
        assert all(torch.equal(got["after"][k], mean[k]) for k in mean)


def test_sequential_samples_under_reshard_after_forward_false_run_each_sample(edge) -> None:
    """``SequentialSamples`` (the BMA's one-sample-at-a-time path) under ``reshard_after_forward=False``:
    each forward runs on its own sample and the forward after the block on the mean, as in the
    unsharded model."""
    import fsdp2_posterior_worker as pw

    from hf_evon.predictive.sequential_samples import SequentialSamples

    model = worker.net()
    mean = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, x, _ = worker.batch(0)
    with torch.no_grad(), SequentialSamples(model, pw.posterior(), 3, seed=pw.SEED) as samples:
        want = samples.each(lambda: model(ids, x))
        want_after = model(ids, x)
    assert not torch.equal(want[0], want[1]) and not torch.equal(want[1], want[2])
    for r in edge[1]:
        got = r["sequential"]
        assert not isinstance(got, str), got
        for s, (a, b) in enumerate(zip(got["outs"], want, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=0, msg=f"sample {s}")
        torch.testing.assert_close(got["after"], want_after, rtol=1e-12, atol=0, msg="after")
        assert all(torch.equal(got["weights"][n], mean[n]) for n in mean)
