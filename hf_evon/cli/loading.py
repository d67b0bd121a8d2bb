"""Where the ``hf-evon`` commands get what they run on: locations (a local directory or a Hub
repo id), the device, the model, its posterior and its tokenizer, and the prompts the model can run.

torch, transformers and the rest of hf_evon are imported inside the functions, so that
``hf-evon -h`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import codecs
import os
import re
from collections.abc import Callable
from typing import Any

from hf_evon.fileio import (
    ANSI_ESCAPE,
    Listed,
    leads_to_directory,
    listed_kind,
    local_directory,
    no_file_text,
    reachable_kind,
    refuse_no_repo_id,
    refused_load_text,
)


# --------------------------------------------------------------------- shared helpers
class UsageError(ValueError):
    """The command line asks for something impossible; reported like argparse's errors (exit 2)."""


def check_location(value: str, option: str) -> str:
    """``"local"`` for an existing directory, ``"hub"`` for a valid repo id; else a clear error.

    Why: huggingface_hub reports a mistyped local path as "Repo id must be in the form ...",
    which hides that the directory does not exist. Only a location not listed here can be a repo id
    (:func:`~hf_evon.fileio.local_directory`): one this user cannot look up raises the OSError naming it,
    and a link that reaches nothing is named as such.
    """
    if local_directory(
        value,
        lambda why: UsageError(f"{option} {value!r} is {why}"),
        lambda: UsageError(f"{option} {value!r} is a file; pass the directory that holds it"),
    ):
        return "local"
    refuse_no_repo_id(
        value,
        lambda: UsageError(f"{option} {value!r}: no such local directory"),
        lambda: UsageError(f"{option} {value!r} is neither a local directory nor a Hub repo id ('name' or 'namespace/name')"),
    )
    return "hub"


def file_errors() -> tuple[type[BaseException], ...]:
    """What reading or writing a model's or a posterior's files raises besides OSError/ValueError:
    safetensors' own error (a truncated file; a full disk while writing), a refused pickle, and
    JSON nested deeper than Python's recursion limit. (An ``except`` evaluates it only once an
    exception is raised, so safetensors is imported only then.)"""
    import pickle

    from safetensors import SafetensorError

    return (SafetensorError, pickle.UnpicklingError, RecursionError)


def _loaded_file(err: BaseException) -> str | None:
    """The file ``torch.load`` was reading where it raised ``err`` (transformers' loaders let its
    refusal through without naming the file); None where no ``torch.load`` call is in the traceback."""
    tb, found = err.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "load" and code.co_filename.endswith(os.path.join("torch", "serialization.py")):
            f = tb.tb_frame.f_locals.get("f")
            found = os.fspath(f) if isinstance(f, str | os.PathLike) else found
        tb = tb.tb_next
    return found


def file_error_text(err: BaseException) -> str:
    """One line: what failed, and the first line of the library's message."""
    import pickle

    if isinstance(err, pickle.UnpicklingError):
        return refused_load_text(_loaded_file(err) or "a pickled file", err)
    lines = (ANSI_ESCAPE.sub("", line).strip() for line in str(err).splitlines())
    first = next((line for line in lines if line), type(err).__name__)
    if isinstance(err, RecursionError):
        return f"a file nests too deeply to read ({first})"
    return f"a safetensors file could not be read or written ({first})"


def failure_text(err: BaseException) -> str | None:
    """The error line of a failure that is no bug: a file that does not load or write
    (:func:`file_errors`), or memory run out (``torch.OutOfMemoryError`` of a GPU, the CPU
    allocator's RuntimeError, MemoryError); None for anything else, which keeps its traceback."""
    if isinstance(err, file_errors()):
        return file_error_text(err)
    import torch

    if isinstance(err, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(err):
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        return (
            f"out of memory ({first}): use fewer --samples (calibrate: a smaller --batch-size or "
            "--block-size), or a device with more memory"
        )
    return None


# a file's first bytes: read before the model loads (an encoding error there fails at once), and
# the least of a prefix tokenized
TEXT_CHUNK_BYTES = 2**16
BYTES_PER_TOKEN = 16  # the first prefix's size per token wanted; well above any tokenizer's average
# tokens wanted past those used: a prefix's last tokens may differ from the whole text's (a word cut)
TOKEN_MARGIN = 64


def read_text(path: str, option: str, max_bytes: int | None = TEXT_CHUNK_BYTES) -> tuple[str, bool]:
    """The UTF-8 text of the file ``path``'s first ``max_bytes`` bytes (less a character the limit
    cuts; None: all of it), and whether that is the whole file; a file in another encoding is a
    usage error naming it (and the offset of the byte)."""
    with open(path, "rb") as fh:
        # at most the file's size (and a byte to see it end): read(n) allocates n bytes first
        data = fh.read() if max_bytes is None else fh.read(min(max_bytes, os.fstat(fh.fileno()).st_size) + 1)
    whole = max_bytes is None or len(data) <= max_bytes
    try:  # an incremental decoder: a character the limit cuts is no error
        return codecs.getincrementaldecoder("utf-8")().decode(data if whole else data[:max_bytes], final=whole), whole
    except UnicodeDecodeError as err:
        byte = f"byte 0x{err.object[err.start]:02x} at offset {err.start}"
        raise UsageError(f"{option} {path!r} is not UTF-8 text ({byte}): convert it to UTF-8") from None


def text_tokens(path: str, option: str, tokenizer: Any, count: int) -> Any:
    """The first ``count`` token ids (fewer where the file holds fewer) of the UTF-8 file ``path``
    as ``tokenizer`` splits the whole text, from a prefix of it: a command that uses a few blocks of
    a large file neither reads nor tokenizes the rest. A prefix is taken at ``BYTES_PER_TOKEN``
    bytes per token wanted, and four times longer until it gives ``TOKEN_MARGIN`` tokens more
    than wanted (its last tokens may be a word the prefix cuts) or is the whole file."""
    size = max(TEXT_CHUNK_BYTES, (count + TOKEN_MARGIN) * BYTES_PER_TOKEN)
    while True:
        text, whole = read_text(path, option, size)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        if whole or len(ids) >= count + TOKEN_MARGIN:
            return ids[:count]
        size *= 4


def unreachable_hub(repo_id: str) -> str | None:
    """Why the Hub cannot serve ``repo_id`` here, or None (it answers, or some of the repo is in the
    local cache, or ``HF_HUB_OFFLINE`` is set: the libraries then load from the cache).

    Why: offline, huggingface_hub retries every file request five times with backoff, so a
    mistyped location (``out/run`` with no ``out/`` here) takes most of a minute to fail; one request to the
    endpoint, without retries, tells at once.

    The repo's folder in the cache is looked up by :func:`~hf_evon.fileio.reachable_kind`: one this user
    cannot look up raises the OSError naming it, and a link there that reaches nothing (a cache on a
    disk not mounted) raises the FileNotFoundError naming it: every load of the repo, online or not,
    stops at it, so neither is "nothing of it in the cache"."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return None
    cached = os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo_id, repo_type="model"))
    kind = reachable_kind(
        cached, lambda why: FileNotFoundError(f"the Hub cache's folder of {repo_id!r} ({cached!r}) is {why}")
    )
    if leads_to_directory(cached, kind):
        return None
    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as err:  # any failure to get an answer: DNS, refused, proxy, timeout
        first = (str(err).strip().splitlines() or [""])[0]
        return f"{constants.ENDPOINT} cannot be reached ({type(err).__name__}: {first})"
    return None


def from_location(value: str, option: str, load: Callable[[], Any], subfolder: tuple[str, str | None] = ("", None)) -> Any:
    """``load()``, with a Hub failure reported as such (the value was not a local directory), and
    a file that does not load reported with the option it came from; an unreachable Hub is
    reported before ``load`` starts its retries (:func:`unreachable_hub`). ``subfolder``: (its option,
    its value): a local directory must hold it, as the directory must exist (a usage error)."""
    where = check_location(value, option)
    if where == "local" and subfolder[1] and not os.path.isdir(os.path.join(value, subfolder[1])):
        raise UsageError(f"{subfolder[0]} {subfolder[1]!r}: no such directory in {option} {value!r}")
    if where == "hub" and (why := unreachable_hub(value)) is not None:
        raise OSError(
            f"{option} {value!r} is not a local directory, so it was looked up on the Hugging Face Hub, "
            f"which failed: {why}, and nothing of it is in the local cache; pass an existing local "
            "directory, or a Hub repo id once the Hub can be reached"
        )
    try:
        return load()
    except file_errors() as err:
        raise ValueError(f"{option} {value!r}: {file_error_text(err)}") from err
    except OSError as err:
        if where == "local":
            raise
        raise OSError(
            f"{option} {value!r} is not a local directory, so it was looked up on the Hugging Face Hub, "
            f"which failed: {err}"
        ) from err


def torch_dtype(name: str) -> Any:
    import torch

    return None if name == "auto" else getattr(torch, name)


def resolve_device(name: str | None) -> Any:
    """The ``torch.device`` for ``--device``, checked to exist here (before any model is loaded)."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1, mps)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise UsageError(f"--device {name!r}: CUDA is not available ({why}); use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UsageError(
                f"--device {name!r}: there are {count} CUDA devices (cuda:0 to cuda:{count - 1})"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {name!r}: MPS is not available on this machine; use --device cpu")
    elif device.type == "meta":
        raise UsageError(f"--device {name!r}: the meta device holds no data (shapes only); use --device cpu")
    elif device.type not in ("cpu", "mps"):  # xpu, hpu, ...: torch raises from deep inside otherwise
        is_available = getattr(getattr(torch, device.type, None), "is_available", None)
        if not (callable(is_available) and is_available()):
            raise UsageError(f"--device {name!r}: torch.{device.type} is not available here; use --device cpu")
    return device


def _listed_file(given: str, *parts: str, option: str = "--model") -> bool:
    """Whether the file ``os.path.join(*parts)`` of ``option given`` (a directory) is there; one listed
    that is a link to nothing or no regular file is refused naming it: taken for none, the directory
    would be read as something else (the root's adapter loaded for a named one, a posterior's folder,
    a model without its tokenizer). One this user cannot look up raises the OSError naming it
    (:func:`~hf_evon.fileio.listed_kind`)."""
    file = os.path.join(*parts)
    kind = listed_kind(file)
    if kind in (None, Listed.FILE):
        return kind is Listed.FILE
    raise UsageError(f"{option} {given!r}: {file!r} is {no_file_text(file, kind)}")


def _may_hold_adapter(entry: str) -> bool:
    """Whether the entry ``entry`` of an adapter's directory may be a PEFT adapter's folder: it lists an
    adapter_config.json, or cannot be looked up (EACCES, a loop of links). An entry that cannot is not
    taken for none: the folder of the adapter loaded is looked up by its name (:func:`_listed_file`),
    and any other entry of the directory is of no use to the load, so it never stops it."""
    try:
        return listed_kind(os.path.join(entry, "adapter_config.json")) is not None
    except OSError:
        return True


def _adapter_folder(given: str, named: str) -> bool:
    """Refuse an adapter name (read from the posterior's parameter names: a file that may come from
    elsewhere) that, as PEFT's folder of a named adapter (``--model``'s ``<name>``), would lead out of
    ``--model``: an absolute path (a name read between dots holds no "..", so none climbs out). True
    for any other."""
    if os.path.isabs(named) or os.path.splitdrive(named)[0]:
        raise UsageError(
            f"the posterior names its PEFT adapter {named!r}, which is no folder inside --model {given!r}: "
            "a posterior of another adapter's parameters (pass the posterior saved with this adapter)"
        )
    return True


def _load_model(path: str, revision: str | None, dtype: Any, adapter: Callable[[], str | None]) -> Any:
    """The causal LM, or encoder-decoder model (its config's ``is_encoder_decoder``), at ``path``;
    a PEFT adapter directory: the adapter on its base model, under the name ``adapter()`` gives (the
    posterior's: PEFT loads any adapter as "default", where the posterior names the one it was
    trained as), also from the folder of that name PEFT saves a named adapter in (``path/<name>``)."""
    from hf_evon.posterior.hub import holds_posterior_config

    peft_kwargs: dict[str, Any] = {}
    given = path
    if os.path.isdir(path) and not _listed_file(given, path, "config.json"):
        inside = _listed_file(given, path, "adapter_config.json")
        if any(_may_hold_adapter(entry.path) for entry in os.scandir(path)):
            # PEFT's save_pretrained puts an adapter not named "default" in path/<name>, and "default" at the
            # root: the root holds the posterior's adapter only where that is "default" or no folder is named so
            named = adapter()
            if named and not (inside and named == "default") and _adapter_folder(given, named) and _listed_file(
                given, path, named, "adapter_config.json"
            ):
                path, inside = os.path.join(path, named), True
        if inside and (named := adapter()) not in (None, "default"):
            peft_kwargs["adapter_name"] = named
    if os.path.isdir(path) and not any(
        _listed_file(given, path, f) for f in ("config.json", "adapter_config.json")
    ):  # transformers would report a missing `model_type` key in the config.json that is not there
        hint = ""
        if holds_posterior_config(path):  # e.g. calibrate's --output
            hint = (": it holds an EVON posterior; pass it as --posterior, and the model's directory or Hub "
                    "repo id as --model")  # fmt: skip
        raise UsageError(f"--model {path!r} holds no config.json (nor a PEFT adapter's adapter_config.json){hint}")
    kwargs: dict[str, Any] = {"revision": revision}
    if dtype is not None:
        kwargs["dtype"] = dtype
    # beside a config.json too: taken for none, the model would load without its adapter (a Hub repo id
    # lists nothing here: check_location has looked it up)
    if _listed_file(given, path, "adapter_config.json"):
        from peft import AutoPeftModelForCausalLM, AutoPeftModelForSeq2SeqLM, PeftConfig

        base = PeftConfig.from_pretrained(path, revision=revision).base_model_name_or_path
        if not base:  # PEFT records none for a model built from a config, not loaded from a path
            raise UsageError(
                f"--model {path!r} is a PEFT adapter whose adapter_config.json names no base model "
                "(base_model_name_or_path is empty): set it to the base model's directory or Hub repo id"
            )
        # the base is a location of its own (often a path relative to where the adapter was trained):
        # one that is not here is reported as the adapter config's, not as a bad Hub repo id
        option = f"the base model (base_model_name_or_path in {os.path.join(path, 'adapter_config.json')!r})"
        seq2seq = from_location(base, option, lambda: _config_is_encoder_decoder(base, None, option))
        auto = AutoPeftModelForSeq2SeqLM if seq2seq else AutoPeftModelForCausalLM
        return _loaded(given, lambda: auto.from_pretrained(path, **kwargs, **peft_kwargs))
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    seq2seq = _config_is_encoder_decoder(path, revision, "--model")
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    model, info = _loaded(given, lambda: auto.from_pretrained(path, **kwargs, output_loading_info=True))
    if missing := info.get("missing_keys"):  # transformers fills them with fresh random values
        raise ValueError(
            f"--model {given!r}: its weights lack {len(missing)} of the model's tensors ({', '.join(sorted(missing)[:3])}"
            f"{', …' if len(missing) > 3 else ''}), which would be random: its config.json and weights do not match"
        )
    return model


def _loaded(path: str, load: Callable[[], Any], passed: tuple[type[Exception], ...] = ()) -> Any:
    """``load()`` of the model (or its config) at ``path``, transformers' or PEFT's own refusal of its
    files (a config.json that disagrees with its weights' sizes, is a JSON list or holds a field of the
    wrong type) reported as one line naming it; a file error, out of memory, ``passed`` (the caller's
    to handle) or an interrupt as they are."""
    try:
        return load()
    except (OSError, MemoryError, *file_errors(), *passed):
        raise
    except Exception as err:  # noqa: BLE001 - the library's error about the files, named here
        if failure_text(err) is not None:  # out of memory
            raise
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(f"--model {path!r}: its files do not load ({type(err).__name__}: {first})") from err


# text generators whose input is not token ids alone: the mapping of their classes, what they are, their
# Auto class, what they read
_NOT_TOKEN_INPUT = (
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "a speech-to-text model", "AutoModelForSpeechSeq2Seq", "audio features"),
    ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "an image-text-to-text model", "AutoModelForImageTextToText", "images"),
)


def _config_is_encoder_decoder(path: str, revision: str | None, option: str) -> bool:
    """Whether the model at ``path`` is an encoder-decoder; a UsageError where its saved class
    (``architectures``) is no language model: the Auto classes would load it with another head,
    a masked LM as a causal one whose attention still sees the tokens it predicts."""
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    def classes(mapping: str) -> set[str]:
        names = getattr(modeling_auto, mapping).values()
        return {n for name in names for n in ([name] if isinstance(name, str) else name or ())}

    try:
        config = _loaded(path, lambda: AutoConfig.from_pretrained(path, revision=revision), (ValueError,))
    except ValueError:
        # transformers' message for a model_type it lacks is a paragraph of pip advice naming no file
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        stored = transformers.PretrainedConfig.get_config_dict(path, revision=revision)[0]
        if not isinstance(stored, dict):
            raise ValueError(f"{option} {path!r}: its config.json is not a JSON object") from None
        model_type = stored.get("model_type")  # (a model of its own code, auto_map, keeps transformers' message)
        if not isinstance(model_type, str) or model_type in CONFIG_MAPPING or "auto_map" in stored:
            raise
        where = repr(os.path.join(path, "config.json")) if os.path.isdir(path) else "its config.json"
        raise UsageError(
            f"{option} {path!r}: {where} has model_type {model_type!r}, which transformers "
            f"{transformers.__version__} does not know"
        ) from None
    language_models = classes("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES") | classes("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES")
    known = set().union(*(classes(m) for m in dir(modeling_auto) if re.fullmatch(r"MODEL_\w*MAPPING_NAMES", m)))
    saved = [a for a in getattr(config, "architectures", None) or [] if isinstance(a, str)]
    # a class transformers does not know (a subclass of one's own) is given the benefit of the doubt
    if saved and known.issuperset(saved) and not language_models.intersection(saved):
        what = f"{option} {path!r} is a {', '.join(saved)} (config.json's architectures)"
        supported = (
            "generate and calibrate run causal LMs (AutoModelForCausalLM), text encoder-decoders "
            "(AutoModelForSeq2SeqLM) and PEFT adapters of them"
        )
        # a model that decodes text from audio or images has a language-modelling head, not token input
        for mapping, kind, auto, reads in _NOT_TOKEN_INPUT:
            if classes(mapping).intersection(saved):
                raise UsageError(
                    f"{what}, {kind} ({auto}), which reads {reads}, not token ids alone: {supported}; decode it "
                    "from Python with hf_evon.generate_bma, passing its input by the model's name for it"
                )
        raise UsageError(
            f"{what}, not a causal LM or an encoder-decoder LM: {supported}, which have a language-modelling head"
        )
    return bool(getattr(config, "is_encoder_decoder", False))


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
)


def _load_tokenizer(path: str, revision: str | None, model: Any) -> Any:
    """The model's tokenizer, or None. A local directory needs tokenizer files: transformers
    would otherwise build an empty tokenizer from the model config alone."""
    from transformers import AutoTokenizer

    from hf_evon.modeling import base_model_name

    for candidate in dict.fromkeys([path, base_model_name(model)]):  # an adapter's: its base model's
        if candidate is None:
            continue
        which = "--model" if candidate == path else "the base model"
        local = os.path.isdir(candidate)  # a location from_location has looked up already
        files = [f for f in _TOKENIZER_FILES if local and _listed_file(candidate, candidate, f, option=which)]
        if local and not files:
            continue
        try:
            tokenizer = AutoTokenizer.from_pretrained(candidate, revision=revision)
        except (MemoryError, *file_errors()):
            raise
        except Exception as err:  # noqa: BLE001 - a file's error (a config that is a JSON list: AttributeError)
            if not files:  # a Hub repo without a tokenizer, or the Hub unreachable: the next candidate
                continue
            # a broken file, as a broken weights file, is an error: not "no tokenizer" (ids printed)
            first = (str(err).strip().splitlines() or [""])[0]
            raise ValueError(
                f"{which} {candidate!r}: its tokenizer files ({', '.join(files)}) do not load "
                f"({type(err).__name__}: {first})"
            ) from err
        if len(tokenizer) > 1:
            return tokenizer
    return None


def load_model_posterior_tokenizer(
    args: argparse.Namespace, device: Any, dtype: Any
) -> tuple[Any, Any, Any]:
    """``--model`` (on ``device``, in eval mode), its posterior (``--posterior``, default ``--model``,
    and ``--posterior-subfolder``) and its tokenizer (or None)."""
    from hf_evon.modeling import adapter_of_names
    from hf_evon.posterior.posterior import EVONPosterior

    location = args.posterior or args.model
    loaded: list[Any] = []  # the posterior, loaded once: before the model where its adapter's name is needed

    def posterior() -> Any:
        if not loaded:
            loaded.append(from_location(
                location,
                "--posterior" if args.posterior else "--model",
                lambda: EVONPosterior.from_pretrained(
                    location, revision=args.revision, subfolder=args.posterior_subfolder, device=device
                ),
                ("--posterior-subfolder", args.posterior_subfolder),
            ))  # fmt: skip
        return loaded[0]

    def adapter() -> str | None:  # None where the posterior does not load: its error follows the model's
        try:
            return adapter_of_names(posterior().names)
        except Exception:  # noqa: BLE001 - raised again by posterior() once the model has loaded
            return None

    model = from_location(args.model, "--model", lambda: _load_model(args.model, args.revision, dtype, adapter))
    model = model.to(device).eval()
    return model, posterior(), _load_tokenizer(args.model, args.revision, model)


def check_prompts(
    input_ids: Any, attention_mask: Any, model: Any, args: argparse.Namespace, encoder_decoder: bool
) -> None:
    """Refuse prompts the model cannot run: empty, token ids outside the embedding table,
    or longer (with the new tokens) than the model's context."""
    option = "--prompt" if args.prompt is not None else "--prompt-ids"
    lengths = attention_mask.sum(dim=1).tolist()
    for row, length in enumerate(lengths):
        if length == 0:
            shown = f" ({args.prompt[row]!r})" if args.prompt is not None else ""
            raise UsageError(f"{option} number {row + 1}{shown} has no tokens: give a non-empty prompt")
    vocab = model.get_input_embeddings().num_embeddings
    used = input_ids[attention_mask.bool()]
    bad = used[(used < 0) | (used >= vocab)]
    if bad.numel():
        raise UsageError(
            f"{option}: token id {int(bad[0])} is outside the model's vocabulary (ids 0 to {vocab - 1})"
        )
    context = getattr(model.config, "max_position_embeddings", None)
    if isinstance(context, int) and context > 0:
        longest = int(max(lengths))
        if longest > context:
            raise UsageError(
                f"{option}: a prompt of {longest} tokens is longer than the model's context of {context} "
                "tokens (config.max_position_embeddings)"
            )
        # an encoder-decoder's decoder starts afresh from its start token; a causal LM continues
        before = 1 if encoder_decoder else longest
        after = "the decoder's start token" if encoder_decoder else f"a prompt of {longest} tokens"
        if before + args.max_new_tokens > context:
            raise UsageError(
                f"--max-new-tokens {args.max_new_tokens} after {after} exceeds the "
                f"model's context of {context} tokens (config.max_position_embeddings): use "
                f"--max-new-tokens {context - before} or less"
            )
