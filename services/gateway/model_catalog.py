"""The models a gateway serves, each with its own tokenizer, chat template and limits.

A gateway serves its own model (`--model`, its files at `--model-path`) and every model a
worker heartbeats. A model's files are read from the first directory that holds them:
`--models-dir/<model>`, then the directory its worker loaded it from (the heartbeat's
`model_path`: a gateway on that host, or on a shared volume, reads it there without any flag),
then `--model-path` for the gateway's own model. Each model loads once, off the event loop,
when its first heartbeat or request comes.

A model no worker has served or holds on its disk (as far as the gateway's worker view
remembers, which is ten heartbeat timeouts) is not found: 404. A model whose workers are all
restarting is still found: its requests wait in the conductor's hold for a worker to come
back (then 503), as do those of a model a worker must load first (`RoleChange.model`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from services.gateway.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from services.gateway.model_info import (
    OPENAI_SAMPLING,
    SamplingDefaults,
    read_model_info,
    read_sampling_defaults,
)
from services.gateway.responses import TokenText
from services.gateway.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer
from services.gateway.validation import Limits
from shared.config import GatewayConfig
from shared.errors import ConfigError, ModelNotFound, WorkerUnavailable
from shared.heartbeats import WorkerDirectory
from shared.logs import get_logger
from shared.model_dir import resolve_model_dir

log = get_logger(__name__)

RETRY_LOAD_S = 30.0


@dataclass(frozen=True)
class ServedModel:
    """What the gateway needs to take a request for one model and write its answer."""

    name: str
    tokenizer: Tokenizer
    template: ChatTemplate
    limits: Limits
    token_text: TokenText


def served_model(name: str, tokenizer: Tokenizer, template: ChatTemplate,
                 max_model_len: int, sampling: SamplingDefaults = OPENAI_SAMPLING
                 ) -> ServedModel:
    return ServedModel(name, tokenizer, template,
                       Limits(name, max_model_len, tokenizer.vocab_size, sampling),
                       TokenText(tokenizer))


def load_model_files(name: str, model_dir: Path, max_model_len: int,
                     template_source: str | None = None, *,
                     sampling_defaults: Literal["model", "openai"] = "model") -> ServedModel:
    """`name`'s tokenizer, chat template (its own, unless `template_source`), limits and,
    with `sampling_defaults` "model", recommended sampling from a Hugging Face model
    directory (no weights are read)."""
    if not (model_dir / "config.json").exists():
        raise ConfigError(f"no model at {model_dir}")
    tokenizer = HfTokenizer(model_dir)
    info = read_model_info(model_dir)
    template = ChatTemplate(template_source or tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE)
    sampling = (read_sampling_defaults(model_dir) if sampling_defaults == "model"
                else OPENAI_SAMPLING)
    if sampling != OPENAI_SAMPLING:
        log.info("model.sampling_defaults", model=name, **asdict(sampling))
    return served_model(name, tokenizer, template,
                        min(max_model_len, info.max_position_embeddings), sampling)


class ModelCatalog:
    """Every model this gateway serves, loaded on first sight (see the module docstring).
    `tokenizer` (tests, or `tokenizer = "bytes"` for the fake and sim engines) serves every
    model with one tokenizer and the default template."""

    def __init__(self, config: GatewayConfig, workers: WorkerDirectory,
                 tokenizer: Tokenizer | None = None, template_source: str | None = None
                 ) -> None:
        self.config = config
        self.workers = workers
        if tokenizer is None and config.tokenizer == "bytes":
            tokenizer = ByteTokenizer()
        self._tokenizer = tokenizer
        self._template_source = template_source  # --chat-template: the own model's
        self._models: dict[str, ServedModel] = {}
        self._loads: dict[str, asyncio.Task[ServedModel]] = {}
        self._failed_at: dict[str, float] = {}  # heartbeats retry a failed load after a while

    @property
    def own_name(self) -> str:
        return self.config.model

    async def start(self) -> ServedModel:
        """Load the gateway's own model (a bad `--model-path` fails the start)."""
        if self._tokenizer is None and not (
                resolve_model_dir(self.config.model_path) / "config.json").exists():
            raise ConfigError(f"no model at {resolve_model_dir(self.config.model_path)}: pass "
                              "--model-path, or run `halfmoon model init` for the built-in one")
        return await self.get(self.own_name)

    def names(self) -> list[str]:
        """The models to list in /v1/models: the gateway's own and every one a live worker
        serves, in name order."""
        return sorted({self.own_name} | self.workers.models(is_alive=True))

    def loaded(self, name: str) -> ServedModel | None:
        model = self._models.get(name)
        return self._fitted(model) if model is not None else None

    def _fitted(self, model: ServedModel) -> ServedModel:
        """`model` with its context cut to what each of its live workers holds (a worker
        whose KV pool holds less than the model's context says so in its heartbeat)."""
        held = self.workers.max_model_len(model.name)
        if held is None or held >= model.limits.max_model_len:
            return model
        return replace(model, limits=replace(model.limits, max_model_len=held))

    def observe(self, model: str) -> None:
        """A worker serves `model`: load it now, before its first request."""
        failed_at = self._failed_at.get(model)
        if model in self._models or model in self._loads or (
                failed_at is not None and time.monotonic() - failed_at < RETRY_LOAD_S):
            return
        self._load(model).add_done_callback(_log_failed_load)

    async def get(self, name: str) -> ServedModel:
        """`name`'s model, loaded if it has to be; ModelNotFound when no worker serves it,
        WorkerUnavailable when this gateway cannot read its files."""
        if (model := self.loaded(name)) is not None:
            return model
        if name != self.own_name and name not in self.workers.models(is_on_disk=True):
            raise ModelNotFound(f"The model `{name}` does not exist", param="model")
        try:
            return self._fitted(await asyncio.shield(self._loads.get(name) or self._load(name)))
        except ConfigError as exc:
            raise WorkerUnavailable(
                f"the model `{name}` is served, but this gateway cannot read its tokenizer "
                f"({exc.message}); give the gateway --models-dir") from exc

    def _load(self, name: str) -> asyncio.Task[ServedModel]:
        task = asyncio.create_task(asyncio.to_thread(self._read, name),
                                   name=f"gateway.load-model.{name}")
        self._loads[name] = task

        def done(finished: asyncio.Task[ServedModel]) -> None:
            self._loads.pop(name, None)
            if finished.cancelled() or finished.exception() is not None:
                self._failed_at[name] = time.monotonic()
            else:
                self._models[name] = finished.result()

        task.add_done_callback(done)
        return task

    def _read(self, name: str) -> ServedModel:
        config = self.config
        if self._tokenizer is not None:
            return served_model(name, self._tokenizer, ChatTemplate(self._template_source
                                                                    or DEFAULT_CHAT_TEMPLATE),
                                config.max_model_len)
        own = self._template_source if name == self.own_name else None
        for model_dir in self._candidates(name):
            if (model_dir / "config.json").exists():
                return load_model_files(name, model_dir, config.max_model_len, own,
                                        sampling_defaults=config.sampling_defaults)
        raise ConfigError(f"none of {', '.join(map(str, self._candidates(name))) or 'no path'}"
                          " holds it")

    def _candidates(self, name: str) -> list[Path]:
        paths = [Path(self.config.models_dir).expanduser() / name] if self.config.models_dir \
            else []
        paths += [Path(p) for p in self.workers.model_paths(name)]
        if name == self.own_name:
            paths.append(resolve_model_dir(self.config.model_path))
        return paths


def _log_failed_load(task: asyncio.Task[ServedModel]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("model.load_failed", task=task.get_name(), error=str(exc))
