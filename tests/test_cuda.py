"""What only a CUDA device exercises: the accelerator refresh on cuSOLVER, torch's fused Adam
with its step counts on the GPU. Skipped without CUDA (the CPU suite stands "meta" in for a
second device, and calls the accelerator refresh with ``householder=False``);
``benchmarks/gpu.sh`` runs this file first on a GPU, with the CUDA cases of other files (a step
that reads nothing back to the host: ``test_optim_flops.py``)."""

from __future__ import annotations

import pytest
import torch
from test_linalg import with_condition_number
from test_optim_state import make_data, make_model, make_opt, roundtrip, train_step

from hf_evon.optim.linalg import cholesky_factors, power_qr, power_qr_many

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_cuda_refresh_equals_the_cpu_refresh() -> None:
    """cuSOLVER's CholeskyQR3 (the lower factor) gives LAPACK's Householder basis, signs fixed."""
    stat = with_condition_number(3, 48, 30.0, seed=2)  # 3 decades in stat: float32 resolves them
    stat = (stat @ stat.mT).float()
    q_old = torch.linalg.qr(with_condition_number(3, 48, 10.0, seed=3)).Q.float()
    cpu = power_qr(stat, q_old)
    cuda = power_qr(stat.cuda(), q_old.cuda()).cpu()
    torch.testing.assert_close(cuda, cpu, rtol=0, atol=1e-3)
    torch.testing.assert_close(cuda.mT @ cuda, torch.eye(48).expand(3, 48, 48), rtol=0, atol=1e-5)


def test_the_cuda_refresh_groups_sides_of_one_size_into_one_call_with_the_same_bases() -> None:
    """Off a CPU, ``power_qr_many`` factors the stacks of one side size together by default: the
    bases equal one call per stack (cuSOLVER factors each member alone; only the batched products'
    kernels may round differently), and the group's shapes come back in order."""
    pairs = []
    for batch, n, seed in ((1, 48, 4), (3, 48, 5), (2, 20, 6), (2, 48, 7)):
        stat = with_condition_number(batch, n, 30.0, seed=seed)
        q_old = torch.linalg.qr(with_condition_number(batch, n, 10.0, seed=seed + 10)).Q.float()
        pairs.append(((stat @ stat.mT).float().cuda(), q_old.cuda()))
    grouped = power_qr_many(pairs)
    alone = power_qr_many(pairs, grouped=False)
    for new, one, (stat, _) in zip(grouped, alone, pairs):
        assert new.shape == stat.shape
        torch.testing.assert_close(new, one, rtol=0, atol=1e-5)


def test_cusolver_factors_a_large_stack_one_member_at_a_time_as_the_batched_call_does() -> None:
    """On CUDA a stack of sides from ``CHOLESKY_ALONE_MIN_SIDE`` on is factored member by member
    (the default there); the factors and flags equal cuSOLVER's batched call's."""
    x = with_condition_number(3, 1600, 100.0, seed=8).cuda()
    gram = x.mT @ x
    gram[1] = -gram[1]
    low, info = cholesky_factors(gram)
    low_batched, info_batched = cholesky_factors(gram, alone=False)
    assert info.tolist()[1] != 0 and info.tolist()[0] == info.tolist()[2] == 0
    assert torch.equal(info.cpu(), info_batched.cpu())
    torch.testing.assert_close(low[[0, 2]], low_batched[[0, 2]], rtol=1e-10, atol=1e-12)


def test_a_cpu_checkpoint_resumes_on_cuda_with_the_step_counts_on_the_gpu() -> None:
    """A state saved on the CPU and loaded for CUDA parameters puts the AdamW groups' step counts
    on the GPU, where torch's fused Adam reads them, and the run goes on as on the CPU."""
    model, data = make_model(), make_data()
    opt = make_opt(model)
    for _ in range(2):
        train_step(model, opt, data)
    saved = roundtrip(opt.state_dict())
    gpu_model = make_model().cuda()
    gpu_model.load_state_dict(model.state_dict())
    gpu_opt = make_opt(gpu_model, ess=float("inf"))  # no noise: the CPU and GPU runs are comparable
    opt_inf = make_opt(model, ess=float("inf"))
    saved["param_groups"] = [dict(g, ess=float("inf")) for g in saved["param_groups"]]
    gpu_opt.load_state_dict(saved)
    opt_inf.load_state_dict(roundtrip(saved))
    biases = gpu_opt.param_groups[1]["params"]
    assert all(gpu_opt.state[b]["step"].device.type == "cuda" for b in biases)
    gpu_data = tuple(t.cuda() for t in data)
    for _ in range(3):
        train_step(gpu_model, gpu_opt, gpu_data)
        train_step(model, opt_inf, data)
    assert all(gpu_opt.state[b]["step"].item() == 5 for b in biases)
    for (name, p), q in zip(model.named_parameters(), gpu_model.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-3, atol=1e-4, msg=name)


def test_seeded_sampling_on_the_cpu_leaves_the_gpus_generator_alone() -> None:
    """A seeded ``generate_bma`` call seeds only the generator it draws tokens from: a call on the
    CPU with a GPU present left the GPU's generator reseeded (``torch.manual_seed`` seeds all)."""
    from test_generation import PROMPTS, tiny_gpt2, train_posterior

    from hf_evon import generate_bma

    model = tiny_gpt2()
    posterior = train_posterior(model)
    state = torch.cuda.get_rng_state()
    generate_bma(model, posterior, PROMPTS, num_samples=2, seed=3, max_new_tokens=3, do_sample=True, pad_token_id=0)
    assert torch.equal(torch.cuda.get_rng_state(), state)


def test_the_trainer_on_cuda_trains_as_on_the_cpu(tmp_path) -> None:
    """``EVONTrainer`` on the GPU (its optimizer state, the AdamW groups' fused kernel, the saved
    posterior) follows the CPU run step for step; no noise (ess = inf), so the runs compare."""
    from test_trainer import classification_rows, config, tiny_bert

    from hf_evon import EVONPosterior, EVONTrainer

    weights, posteriors = {}, {}
    for device in ("cpu", "cuda"):
        args = config(tmp_path / device, use_cpu=device == "cpu", evon_ess=float("inf"), max_steps=4)
        trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_rows(32))
        trainer.train()
        assert {p.device.type for p in trainer.model.parameters()} == {device}
        trainer.save_model()
        weights[device] = {n: p.detach().cpu() for n, p in trainer.model.named_parameters()}
        posteriors[device] = EVONPosterior.from_pretrained(args.output_dir)
    for name, p in weights["cpu"].items():
        torch.testing.assert_close(weights["cuda"][name], p, rtol=1e-3, atol=1e-4, msg=name)
    assert posteriors["cuda"].names == posteriors["cpu"].names
    for name in posteriors["cpu"].names:
        want = posteriors["cpu"][name].hess
        got = posteriors["cuda"][name].hess.cpu()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3 * float(want.abs().max()), msg=name)
