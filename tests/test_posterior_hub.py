"""EVONPosterior on the Hub: the real ``huggingface_hub`` client against a local stand-in.

``tests/hub_stub.py`` serves the Hub endpoints the client uses (create repo/branch,
README validation, preupload + NDJSON commit, model info, HEAD/GET resolve) on
127.0.0.1 with a random free port; the client is pointed at it with ``endpoint=`` (in
process) or ``HF_ENDPOINT`` (in a fresh interpreter) and a dummy token.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import plain_evon
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
from safetensors.torch import load_file
from torch import nn

import hf_evon
from hf_evon import EVONPosterior
from hf_evon.posterior.model_card import RETRACTED_SECTION, SECTION_END, SECTION_START
from hf_evon.posterior.posterior import POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME, MatrixFactors

try:
    from hub_stub import HubStub
except ImportError:  # tests/ imported as a package
    from tests.hub_stub import HubStub

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_dummy_token"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models run as fast on one intra-op thread, and stay fast when the CPUs are shared
    (with 2 threads on 2 busy cores a tiny GPT-2 step took 2 s instead of 0.03 s)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def hub():
    with HubStub() as stub:
        yield stub


@pytest.fixture(scope="module")
def posterior() -> EVONPosterior:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    x, y = torch.randn(128, 6), torch.randn(128, 2)
    opt = hf_evon.build_optimizer(
        model, **plain_evon(lr=0.05, ess=128, betas=(0.9, 0.95), precondition_frequency=2, seed=0)
    )
    for _ in range(6):
        with opt.sampled_params(train=True):
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return EVONPosterior.from_optimizer(opt, model)


def _same(a: EVONPosterior, b: EVONPosterior) -> None:
    assert a.names == b.names and a.ess == b.ess
    ta, tb = a.to_tensors(), b.to_tensors()
    assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    da, db = a.draw(3, seed=21), b.draw(3, seed=21)
    assert all(torch.equal(da[k], db[k]) for k in da)


def _load(hub: HubStub, repo_id: str, cache: Path, **kwargs) -> EVONPosterior:
    return EVONPosterior.from_pretrained(
        repo_id, token=TOKEN, endpoint=hub.endpoint, cache_dir=cache, **kwargs
    )


def test_push_then_load_by_repo_id(hub, posterior, tmp_path):
    info = posterior.push_to_hub("alice/evon-mlp", token=TOKEN, endpoint=hub.endpoint)
    assert info.oid in info.commit_url and hub.commits("alice/evon-mlp")[0] == "Upload EVON posterior"
    files = hub.files("alice/evon-mlp")
    assert {POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME, "README.md"} <= set(files)
    assert ("POST", "/api/models/alice/evon-mlp/preupload/main") in hub.requests
    assert ("POST", "/api/models/alice/evon-mlp/commit/main") in hub.requests
    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "hf-evon" and {"evon", "variational-inference"} <= set(card.data.tags)
    assert 'EVONPosterior.from_pretrained("alice/evon-mlp")' in card.text

    loaded = _load(hub, "alice/evon-mlp", tmp_path / "cache")
    _same(posterior, loaded)
    assert ("HEAD", f"/alice/evon-mlp/resolve/main/{POSTERIOR_CONFIG_NAME}") in hub.requests
    # the weights at the commit the config came from
    assert ("HEAD", f"/alice/evon-mlp/resolve/{info.oid}/{POSTERIOR_WEIGHTS_NAME}") in hub.requests
    # the download is cached: it loads again without the server
    _same(posterior, _load(hub, "alice/evon-mlp", tmp_path / "cache", local_files_only=True))
    with pytest.raises(LocalEntryNotFoundError):
        _load(hub, "alice/evon-mlp", tmp_path / "empty-cache", local_files_only=True)


def test_a_push_between_the_config_and_the_weights_downloads_loads_the_configs_commit(
    hub, posterior, tmp_path, monkeypatch
):
    """The weights were downloaded at the unpinned revision after the config: a push landing
    between the two paired one commit's config with the next one's weights, refused as a mix."""
    import hf_evon.posterior.hub as hub_module

    other = posterior.with_ess(posterior.ess * 7)
    posterior.push_to_hub("alice/race", token=TOKEN, endpoint=hub.endpoint)
    real, calls = hub_module.hf_hub_download, []

    def download(repo_id, filename, **kwargs):  # noqa: ANN001, ANN003, ANN202
        out = real(repo_id, filename, **kwargs)
        if kwargs.get("dry_run"):  # the config's size, asked before its download
            return out
        if filename in (POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME) and len(calls) < 2:
            calls.append((filename, kwargs.get("revision")))
            if len(calls) == 1:  # a colleague's push, right after the config's download
                other.push_to_hub("alice/race", token=TOKEN, endpoint=hub.endpoint)
        return out

    monkeypatch.setattr(hub_module, "hf_hub_download", download)
    _same(posterior, _load(hub, "alice/race", tmp_path / "cache"))
    assert calls[0] == (POSTERIOR_CONFIG_NAME, None)
    assert calls[1][0] == POSTERIOR_WEIGHTS_NAME and len(calls[1][1]) == 40  # at the config's commit


def test_revision_subfolder_and_pull_request(hub, posterior, tmp_path):
    repo = "alice/evon-revisions"
    posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint)
    tempered = posterior.with_ess(4 * posterior.ess)
    tempered.push_to_hub(
        repo, token=TOKEN, endpoint=hub.endpoint, revision="tempered", path_in_repo="posterior"
    )
    assert f"posterior/{POSTERIOR_WEIGHTS_NAME}" in hub.files(repo, "tempered")
    assert f"posterior/{POSTERIOR_WEIGHTS_NAME}" not in hub.files(repo, "main")
    card = ModelCard(hub.files(repo, "tempered")["README.md"].decode())
    assert 'subfolder="posterior"' in card.text and card.text.count(SECTION_START) == 1

    _same(tempered, _load(hub, repo, tmp_path, revision="tempered", subfolder="posterior"))
    _same(posterior, _load(hub, repo, tmp_path))  # main is untouched
    with pytest.raises(FileNotFoundError, match=rf"{POSTERIOR_CONFIG_NAME} is missing"):
        _load(hub, repo, tmp_path, subfolder="posterior")  # not on main
    with pytest.raises(RevisionNotFoundError):
        _load(hub, repo, tmp_path, revision="no-such-branch")

    info = posterior.with_ess(2 * posterior.ess).push_to_hub(
        repo, token=TOKEN, endpoint=hub.endpoint, create_pr=True
    )
    assert info.pr_url is not None and info.pr_revision == "refs/pr/1"
    assert _load(hub, repo, tmp_path, revision="refs/pr/1").ess == 2 * posterior.ess
    assert _load(hub, repo, tmp_path).ess == posterior.ess  # a PR does not change main


def test_push_beside_a_model_keeps_its_files_and_updates_its_card(hub, posterior, tmp_path):
    repo = "alice/model-with-posterior"
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo(repo)
    model_files = {
        "config.json": json.dumps({"model_type": "gpt2"}).encode(),
        "model.safetensors": os.urandom(4096),
        "README.md": b"---\nlicense: apache-2.0\nlibrary_name: transformers\ntags:\n- text-generation\n---\n\n# A model\n\nIts own text.\n",
    }
    for path, data in model_files.items():
        api.upload_file(path_or_fileobj=data, path_in_repo=path, repo_id=repo)
    posterior.push_to_hub(
        repo,
        token=TOKEN,
        endpoint=hub.endpoint,
        model_card_kwargs={"metrics": {"eval_loss": 1.25, "eval_bma_loss": 1.20}},
    )
    files = hub.files(repo)
    assert all(files[p] == data for p, data in model_files.items() if p != "README.md")
    card = ModelCard(files["README.md"].decode())
    assert card.data.license == "apache-2.0" and card.data.library_name == "transformers"
    assert card.data.tags[0] == "text-generation" and "evon" in card.data.tags
    assert card.text.lstrip().startswith("# A model\n\nIts own text.")
    assert "| loss | 1.25 | 1.2 |" in card.text

    posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint)  # again: one EVON section
    assert ModelCard(hub.files(repo)["README.md"].decode()).text.count(SECTION_START) == 1
    assert all(hub.files(repo)[p] == data for p, data in model_files.items() if p != "README.md")


def test_a_pushed_cards_snippet_loads_a_tokenizer_only_where_the_repo_has_one(hub, posterior, tmp_path):
    """The pushed card's snippet called ``AutoTokenizer.from_pretrained`` on the repo whether or
    not it held a tokenizer. A language model's card feeds token ids until the repo holds one; a
    local save without one gets no tokenizer line either. An MLP's card loads no tokenizer and no
    transformers model at all: the user builds it as in training."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def card_code(repo: str) -> str:
        return ModelCard(hub.files(repo)["README.md"].decode()).text.split("```python\n", 1)[1].split("```")[0]

    posterior.push_to_hub("alice/mlp-no-tokenizer", token=TOKEN, endpoint=hub.endpoint)
    snippet = card_code("alice/mlp-no-tokenizer")
    assert "AutoTokenizer" not in snippet and "AutoModel" not in snippet
    assert "model = ...  # your Sequential as built in training" in snippet

    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16))
    opt = hf_evon.build_optimizer(lm)
    ids = torch.randint(0, 32, (2, 8))
    with opt.sampled_params(train=True):
        lm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    lm_posterior = EVONPosterior.from_optimizer(opt, lm)
    repo = "alice/lm-no-tokenizer"
    lm_posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint)
    snippet = card_code(repo)
    token_ids = "input_ids = torch.tensor([[0, 1, 2, 3]])  # token ids: no tokenizer was saved with the model"
    assert "AutoTokenizer" not in snippet and token_ids in snippet
    lm_posterior.save_pretrained(tmp_path)
    assert "AutoTokenizer" not in (tmp_path / "README.md").read_text()

    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.upload_file(path_or_fileobj=b"{}", path_in_repo="tokenizer_config.json", repo_id=repo)
    lm_posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint)
    snippet = card_code(repo)
    assert f'tokenizer = AutoTokenizer.from_pretrained("{repo}")' in snippet and "token ids" not in snippet


def test_save_pretrained_with_push_to_hub(hub, posterior, tmp_path):
    posterior.save_pretrained(
        tmp_path / "local", push_to_hub=True, repo_id="alice/pushed", token=TOKEN, endpoint=hub.endpoint
    )
    assert (tmp_path / "local" / POSTERIOR_WEIGHTS_NAME).is_file()
    assert load_file(tmp_path / "local" / POSTERIOR_WEIGHTS_NAME).keys() == posterior.to_tensors().keys()
    _same(posterior, _load(hub, "alice/pushed", tmp_path / "cache"))


def test_missing_repo_and_missing_posterior(hub, tmp_path):
    with pytest.raises(RepositoryNotFoundError):
        _load(hub, "alice/does-not-exist", tmp_path)
    HfApi(endpoint=hub.endpoint, token=TOKEN).create_repo("alice/empty")
    with pytest.raises(FileNotFoundError, match=rf"alice/empty: {POSTERIOR_CONFIG_NAME} is missing"):
        _load(hub, "alice/empty", tmp_path)


def test_a_corrupt_file_on_the_hub_is_named_by_the_repo_it_came_from(hub, posterior, tmp_path):
    """A posterior file the Hub serves but that does not load was named by its Hub cache path alone
    (``.../models--alice--broken/snapshots/<sha>/...``): the error also names the repo, as a missing one does."""
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    for k, (name, data) in enumerate([(POSTERIOR_WEIGHTS_NAME, b"garbage, not safetensors"), (POSTERIOR_CONFIG_NAME, b"{not json")]):
        repo = f"alice/broken{k}"
        posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint)
        api.upload_file(path_or_fileobj=data, path_in_repo=name, repo_id=repo)
        with pytest.raises(hf_evon.PosteriorMismatchError, match=rf"^EVON posterior at {repo}: .*snapshots.*{name}"):
            _load(hub, repo, tmp_path / f"cache{k}")


def test_load_by_repo_id_in_a_fresh_process_via_hf_endpoint(hub, posterior, tmp_path):
    posterior.push_to_hub("alice/fresh", token=TOKEN, endpoint=hub.endpoint, eigenbasis_dtype=torch.bfloat16)
    code = """
        import sys
        from safetensors.torch import save_file
        from hf_evon import EVONPosterior

        p = EVONPosterior.from_pretrained("alice/fresh")
        out = dict(p.to_tensors())
        out.update({n + ".draw": v.contiguous() for n, v in p.draw(2, seed=3).items()})
        save_file(out, sys.argv[1])
        print(p.config["eigenbasis_dtype"])
    """
    env = dict(
        os.environ,
        HF_ENDPOINT=hub.endpoint,
        HF_TOKEN=TOKEN,
        HF_HOME=str(tmp_path / "hf_home"),
        OMP_NUM_THREADS="1",
    )
    env.pop("HF_HUB_OFFLINE", None)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(tmp_path / "dump.safetensors")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "bfloat16"
    here = _load(hub, "alice/fresh", tmp_path / "cache")  # same bytes, loaded in this process
    dump = load_file(tmp_path / "dump.safetensors")
    expected = dict(here.to_tensors())
    expected.update({n + ".draw": v for n, v in here.draw(2, seed=3).items()})
    assert set(dump) == set(expected) and all(torch.equal(dump[k], v) for k, v in expected.items())
    # and the bfloat16 bases are the originals rounded, upcast to float32
    for name in posterior.names:
        assert torch.equal(here[name].Q_L, posterior[name].Q_L.to(torch.bfloat16).float())


def test_bad_push_arguments_are_refused_before_the_repo_is_created(hub, posterior, tmp_path):
    """An eigenbasis dtype that is no float, or card metrics that are no mapping, failed after
    ``create_repo``: the Hub kept a new (public by default) repo holding nothing of the posterior;
    the metrics failed with "'str' object has no attribute 'items'". A local save refuses them
    before writing anything too."""
    with pytest.raises(ValueError, match="eigenbasis_dtype"):
        posterior.push_to_hub("alice/bad-dtype", token=TOKEN, endpoint=hub.endpoint, eigenbasis_dtype=torch.int8)
    with pytest.raises(TypeError, match=r"model_card_kwargs\['metrics'\] must be a mapping"):
        posterior.push_to_hub("alice/bad-card", token=TOKEN, endpoint=hub.endpoint, model_card_kwargs={"metrics": "x"})
    assert "alice/bad-dtype" not in hub.repos and "alice/bad-card" not in hub.repos
    with pytest.raises(TypeError, match=r"model_card_kwargs\['metrics'\] must be a mapping"):
        posterior.save_pretrained(tmp_path / "local", model_card_kwargs={"metrics": "x"})
    assert not (tmp_path / "local" / POSTERIOR_CONFIG_NAME).exists()


@pytest.mark.parametrize("subfolder", ["sub/", "/sub", "sub"])
def test_a_subfolder_loads_with_the_slashes_the_push_accepts(hub, posterior, tmp_path, subfolder):
    """``push_to_hub(path_in_repo="sub/")`` strips the slashes; ``from_pretrained(subfolder="sub/")``
    did not ("…/resolve/main/sub//…: evon_posterior_config.json is missing"; "/sub": an invalid
    filename), though a local directory loads either way."""
    posterior.push_to_hub("alice/nested", token=TOKEN, endpoint=hub.endpoint, path_in_repo=subfolder)
    assert POSTERIOR_CONFIG_NAME in {p.split("/")[-1] for p in hub.files("alice/nested") if p.startswith("sub/")}
    _same(posterior, _load(hub, "alice/nested", tmp_path / "cache", subfolder=subfolder))


def _snippet_call(card_text: str, prefix: str) -> tuple[list, dict]:
    """The arguments of the card snippet's line that starts with ``prefix`` (a ``from_pretrained`` call)."""
    code = card_text.split("```python\n", 1)[1].split("```")[0]
    line = next(line for line in code.splitlines() if line.startswith(prefix))
    call = ast.parse(line).body[0].value
    return [ast.literal_eval(a) for a in call.args], {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def test_a_card_pushed_to_a_branch_loads_the_branchs_posterior_and_model(hub, posterior, tmp_path):
    """``push_to_hub(revision="v2")`` put a card on the branch whose snippet loaded from the default
    branch: ``EVONPosterior.from_pretrained(repo, subfolder=...)`` without ``revision``, so it loaded
    main's posterior (another one, here) or failed for want of one there; the model line too."""
    repo = "alice/evon-branch-card"
    tempered = posterior.with_ess(4 * posterior.ess)
    posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint, path_in_repo="post")
    tempered.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint, revision="v2", path_in_repo="post")
    card = ModelCard(hub.files(repo, "v2")["README.md"].decode()).text
    args, kwargs = _snippet_call(card, "posterior = EVONPosterior.from_pretrained(")
    _same(tempered, _load(hub, *args, tmp_path / "cache", **kwargs))
    main_card = ModelCard(hub.files(repo)["README.md"].decode()).text
    args, kwargs = _snippet_call(main_card, "posterior = EVONPosterior.from_pretrained(")
    assert (args, kwargs) == ([repo], {"subfolder": "post"})  # the default branch needs no revision

    factors = MatrixFactors(None, None, torch.ones(8, 32), (8, 32), (8, 32), 100.0, 1e-3)
    lm_posterior = EVONPosterior.from_factors(
        {"transformer.h.0.mlp.c_fc.weight": factors}, {"model_class": "GPT2LMHeadModel"}
    )
    lm_posterior.push_to_hub("alice/lm-branch", token=TOKEN, endpoint=hub.endpoint, revision="v2")
    card = ModelCard(hub.files("alice/lm-branch", "v2")["README.md"].decode()).text
    assert _snippet_call(card, "model = AutoModelForCausalLM.from_pretrained(") == (
        ["alice/lm-branch"],
        {"revision": "v2"},
    )


def test_offline_without_a_cache_names_the_repo_and_file(hub, posterior, tmp_path):
    """``local_files_only=True`` with nothing cached raised huggingface_hub's "Cannot find the
    requested files in the disk cache ..." naming neither the repo nor the file."""
    posterior.push_to_hub("alice/offline", token=TOKEN, endpoint=hub.endpoint, revision="v1")
    with pytest.raises(LocalEntryNotFoundError, match=rf"alice/offline/sub \(revision v1\).*{POSTERIOR_CONFIG_NAME}"):
        _load(hub, "alice/offline", tmp_path / "empty", local_files_only=True, revision="v1", subfolder="sub")
    _load(hub, "alice/offline", tmp_path / "cache", revision="v1")
    _same(posterior, _load(hub, "alice/offline", tmp_path / "cache", local_files_only=True, revision="v1"))


def test_a_config_larger_than_the_limit_is_refused_before_its_download(hub, posterior, tmp_path, monkeypatch):
    """read_config reads at most MAX_CONFIG_BYTES, but the config was downloaded whole first: a repo's
    config of any size filled the Hub cache's disk before being refused. Its size on the Hub (the HEAD
    request a download makes) is checked first; the error names the repo and the file."""
    import hf_evon.posterior.format as posterior_format

    repo = "alice/big-config"
    posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint)
    size = len(hub.files(repo)[POSTERIOR_CONFIG_NAME])
    get_config = ("GET", f"/{repo}/resolve/main/{POSTERIOR_CONFIG_NAME}")
    monkeypatch.setattr(posterior_format, "MAX_CONFIG_BYTES", size - 1)
    seen = len(hub.requests)
    message = rf"{repo}: {POSTERIOR_CONFIG_NAME} is {size} bytes on the Hub, larger than {size - 1} bytes"
    with pytest.raises(hf_evon.PosteriorMismatchError, match=message):
        _load(hub, repo, tmp_path / "cache")
    assert get_config not in hub.requests[seen:]
    assert not any(files for _, _, files in os.walk(tmp_path / "cache" / "models--alice--big-config" / "blobs"))
    monkeypatch.setattr(posterior_format, "MAX_CONFIG_BYTES", size)  # a config of exactly the limit loads
    _same(posterior, _load(hub, repo, tmp_path / "cache"))
    assert get_config in hub.requests[seen:]


def test_a_pull_request_to_a_new_branch_creates_the_branch(hub, posterior, tmp_path):
    """``push_to_hub(revision="v3", create_pr=True)`` did not create the missing branch the docstring
    promises (transformers' push_to_hub does): the commit failed with "Revision Not Found"."""
    repo = "alice/pr-branch"
    posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint)
    tempered = posterior.with_ess(3 * posterior.ess)
    info = tempered.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint, revision="v3", create_pr=True)
    assert info.pr_revision == "refs/pr/1"
    assert hub.repos[repo]["branches"]["v3"] == hub.repos[repo]["branches"]["main"]  # the PR is not merged
    _same(tempered, _load(hub, repo, tmp_path, revision="refs/pr/1"))
    _same(posterior, _load(hub, repo, tmp_path, revision="v3"))


def test_a_pull_request_without_write_access_to_the_branch_is_still_opened(hub, posterior, tmp_path, monkeypatch):
    """Without write access the Hub refuses ``create_branch`` (403), as transformers' push_to_hub allows
    for a pull request: one to an existing branch is still opened; any other push fails."""
    from types import SimpleNamespace

    from huggingface_hub.errors import HfHubHTTPError

    repo = "alice/pr-no-write"
    posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint, revision="v1")

    def refuse(self, repo_id, *, branch, **kwargs):  # noqa: ANN001, ANN003, ANN202
        raise HfHubHTTPError(f"403 Forbidden: {branch}", response=SimpleNamespace(status_code=403, headers={}, request=None))

    monkeypatch.setattr(HfApi, "create_branch", refuse)
    tempered = posterior.with_ess(5 * posterior.ess)
    info = tempered.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint, revision="v1", create_pr=True)
    _same(tempered, _load(hub, repo, tmp_path, revision=info.pr_revision))
    with pytest.raises(HfHubHTTPError, match="403 Forbidden: v1"):
        tempered.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint, revision="v1")


@pytest.mark.parametrize("folder", ["", "post"])
def test_a_push_removes_the_staged_weights_a_folder_upload_left_in_the_repo(hub, posterior, folder):
    """A folder uploaded right after an interrupted save (the trainer's push of its output directory)
    holds the staged ``evon_posterior.<checkpoint_id>.safetensors``, named by its config. A later
    push wrote the canonical pair beside it and left the staged file, orphaned, in the repo."""
    repo = f"alice/staged-{folder or 'root'}"
    prefix = f"{folder}/" if folder else ""
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo(repo)
    staged = f"evon_posterior.{'ab' * 16}.safetensors"
    for name, data in {staged: b"old weights", "model.safetensors": b"model", "notes.txt": b"x"}.items():
        api.upload_file(path_or_fileobj=data, path_in_repo=prefix + name, repo_id=repo)
    api.upload_file(path_or_fileobj=b"kept", path_in_repo=f"other/{staged}", repo_id=repo)
    posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint, path_in_repo=folder)
    files = hub.files(repo)
    assert prefix + staged not in files
    assert {prefix + POSTERIOR_WEIGHTS_NAME, prefix + POSTERIOR_CONFIG_NAME} <= set(files)
    assert files[prefix + "model.safetensors"] == b"model" and files[prefix + "notes.txt"] == b"x"
    assert files[f"other/{staged}"] == b"kept"  # another folder's files are not this push's


def test_save_pretrained_without_a_card_pushes_none(hub, posterior, tmp_path):
    """``save_pretrained(push_to_hub=True, model_card=False)`` wrote no local card but pushed one:
    ``model_card`` was not passed on, so the repo's README got an EVON section (a repo without one
    got a README). As locally: no card is written, and an EVON section already there (describing the
    posterior replaced) becomes the note naming the config."""
    push = {"push_to_hub": True, "token": TOKEN, "endpoint": hub.endpoint, "model_card": False}
    posterior.save_pretrained(tmp_path / "bare", repo_id="alice/no-card", **push)
    assert not (tmp_path / "bare" / "README.md").exists()
    assert set(hub.files("alice/no-card")) == {".gitattributes", POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME}

    posterior.push_to_hub("alice/old-card", token=TOKEN, endpoint=hub.endpoint)
    card = hub.files("alice/old-card")["README.md"].decode()
    start, end = card.index(SECTION_START), card.index(SECTION_END)
    posterior.with_ess(2 * posterior.ess).save_pretrained(tmp_path / "old", repo_id="alice/old-card", **push)
    pushed = hub.files("alice/old-card")["README.md"].decode()
    assert pushed == card[:start] + RETRACTED_SECTION + card[end + len(SECTION_END) :]
    assert _load(hub, "alice/old-card", tmp_path / "cache").ess == 2 * posterior.ess


def test_an_edit_of_the_repo_during_a_push_is_not_overwritten(hub, posterior, monkeypatch):
    """A push read the repo's README.md, edited its EVON section and committed without pinning the
    parent commit: an edit landing between the read and the commit was silently overwritten. The
    commit is pinned to the revision the card was read at; a conflict says so, and a retry pushes."""
    import hf_evon.posterior.hub as hub_module

    repo = "alice/concurrent-card"
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo(repo)
    api.upload_file(path_or_fileobj=b"# A model\n\nIts own text.\n", path_in_repo="README.md", repo_id=repo)
    edited = b"# A model\n\nA colleague's edit.\n"
    real, edits = hub_module.hf_hub_download, []

    def download(repo_id, filename, **kwargs):  # noqa: ANN001, ANN003, ANN202
        out = real(repo_id, filename, **kwargs)
        if filename == "README.md" and not edits:  # a colleague's edit, right after the card is read
            edits.append(api.upload_file(path_or_fileobj=edited, path_in_repo="README.md", repo_id=repo))
        return out

    monkeypatch.setattr(hub_module, "hf_hub_download", download)
    before = hub.commits(repo)
    with pytest.raises(RuntimeError, match=f"{repo} changed during the push.*push again") as caught:
        posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint)
    assert edits and hub.commits(repo) == [edits[0].commit_message, *before]  # nothing of the push landed
    assert hub.files(repo)["README.md"] == edited and POSTERIOR_CONFIG_NAME not in hub.files(repo)
    assert "main" in str(caught.value)

    posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint)  # the retry keeps the edit
    card = hub.files(repo)["README.md"].decode()
    assert "A colleague's edit." in card and card.count(SECTION_START) == 1


def test_a_card_added_during_a_push_to_a_repo_without_one_is_not_overwritten(hub, posterior, monkeypatch):
    """A push to a repo with no README.md pinned no parent commit (only a card read gave one): a
    README.md added by someone else between the push's look for it and its commit was replaced by
    the push's card. The push pins the branch's commit it read; the commit is refused instead."""
    import hf_evon.posterior.hub as hub_module

    repo = "alice/concurrent-first-card"
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo(repo)
    theirs = b"# A model\n\nA colleague's first card.\n"
    real, edits = hub_module.hf_hub_download, []

    def download(repo_id, filename, **kwargs):  # noqa: ANN001, ANN003, ANN202
        try:
            return real(repo_id, filename, **kwargs)
        finally:
            if filename == "README.md" and not edits:  # a colleague's card, right after the look for one
                edits.append(api.upload_file(path_or_fileobj=theirs, path_in_repo="README.md", repo_id=repo))

    monkeypatch.setattr(hub_module, "hf_hub_download", download)
    before = hub.commits(repo)
    with pytest.raises(RuntimeError, match=f"{repo} changed during the push.*push again"):
        posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint)
    assert edits and hub.commits(repo) == [edits[0].commit_message, *before]  # nothing of the push landed
    assert hub.files(repo)["README.md"] == theirs and POSTERIOR_CONFIG_NAME not in hub.files(repo)

    posterior.push_to_hub(repo, token=TOKEN, endpoint=hub.endpoint)  # the retry keeps their card
    card = hub.files(repo)["README.md"].decode()
    assert "A colleague's first card." in card and card.count(SECTION_START) == 1
