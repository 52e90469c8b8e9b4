"""LLM: vLLM's offline API (``LLM(model=dir).generate(prompts, params)``)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from omniserve.engine.arg_checks import without_vllm_only
from omniserve.engine.arg_utils import EngineArgs
from omniserve.engine.llm_engine import LLMEngine
from omniserve.entrypoints.beam_search import BeamSearchBatch, BeamSearchOutput, BeamSearchParams
from omniserve.entrypoints.chat_utils import ChatRenderer
from omniserve.entrypoints.score_utils import score_pair_text, score_pairs
from omniserve.inputs.data import PromptType, TokensPrompt
from omniserve.inputs.preprocess import checked_token_ids
from omniserve.lora.request import LoRARequest
from omniserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    EncodingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from omniserve.sampling_params import (
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
    embedding_params,
)

Conversation = list[dict[str, Any]]
UseTqdm = bool | Callable[..., Any] | None
"""vLLM's ``use_tqdm``: show a progress bar (None: no), or the callable to build it with in place
of ``tqdm`` (e.g. ``functools.partial(tqdm, leave=False)``; a bar needs update and close)."""


def _conversations(messages: Conversation | list[Conversation]) -> list[Conversation]:
    """One conversation (a list of message dicts) or several, as a list of conversations;
    ``TypeError`` for anything else (a bare string would be read as its characters)."""
    if messages == []:
        return []
    many = isinstance(messages, list) and isinstance(messages[0], list)
    conversations = messages if many else [messages]
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
            where = f"messages[{i}]" if many else "messages"
            raise TypeError(
                f"{where} must be a conversation (a list of message dicts), not "
                f"{type(conversation).__name__}."
            )
    return conversations  # type: ignore[return-value]  # checked above


class LLM:
    """Generate for a batch of prompts with continuous batching, offline."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        args = EngineArgs(model=model, **without_vllm_only(kwargs))
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without sampling params: the checkpoint's
        recommended settings (``generation_config``), else SamplingParams' defaults."""
        return SamplingParams(**self.llm_engine.config.model_config.default_sampling_params())

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        priority: int | Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in prompt order; ``priority`` (lower first)
        needs ``scheduling_policy="priority"``; ``lora_request``: the LoRA adapter (needs
        ``enable_lora=True``). Each, as ``sampling_params``, is one for every prompt or a list
        of one per prompt."""
        prompts = _prompt_list(prompts)
        make_bar = _progress_bar(use_tqdm)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        num = len(prompts)
        params = _per_prompt(sampling_params, num, "sampling_params", SamplingParams,
                             "a SamplingParams", "sampling params")  # fmt: skip
        priorities = [int(p) for p in _per_prompt(0 if priority is None else priority, num,
                                                  "priority", numbers.Integral, "an int",
                                                  "priorities")]  # fmt: skip
        loras = _per_prompt(lora_request, num, "lora_request", (LoRARequest, type(None)),
                            "a LoRARequest (or None)", "LoRA requests")  # fmt: skip
        request_ids = self._add_requests(prompts, params, priorities, loras)
        return self._run_engine(request_ids, make_bar)

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template (loading any attached media), then
        generate. Content parts are those of the OpenAI API, plus ``image_pil`` and
        ``audio_array`` for in-memory media; ``tools`` (OpenAI's function tools) are listed for
        the model by templates that take them (its calls are in the text, as vLLM's LLM.chat);
        ``chat_template_content_format`` as the server's ``--chat-template-content-format``."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(
                f"chat_template_kwargs must be a dict, not {type(chat_template_kwargs).__name__}."
            )
        # Checked before any media is fetched, as the server does; a text model ignores them.
        processor = self.llm_engine.processor
        if processor.mm_processor is not None or not isinstance(mm_processor_kwargs, dict | None):
            processor.check_mm_kwargs({} if mm_processor_kwargs is None else mm_processor_kwargs)
        conversations = _conversations(messages)
        renderer = ChatRenderer.from_config(
            self.llm_engine.config, self.get_tokenizer(), chat_template,
            chat_template_content_format,
        )  # fmt: skip
        prompts: list[PromptType] = [
            renderer.render(
                conversation,
                mm_processor_kwargs=mm_processor_kwargs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EncodingRequestOutput]:
        """Each prompt's raw pooling result, in prompt order, as a tensor (vLLM's
        ``LLM.encode``): ``pooling_task`` (else ``pooling_params.task``, else the model's:
        classify on a sequence classifier, else embed) is "embed" or "classify" (one vector,
        as ``embed`` and ``classify`` give it), or "token_embed" or "token_classify" (a row per
        prompt position: each one's final state embedded, or its label scores);
        ``truncate_prompt_tokens`` as ``embed``'s."""
        params = embedding_params(_with_task(pooling_params, pooling_task, truncate_prompt_tokens))
        outputs = self.generate(prompts, params, use_tqdm, lora_request=lora_request)
        return [EncodingRequestOutput.from_output(output) for output in outputs]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, in prompt order: its final hidden states pooled as
        ``pooling_params`` says (fields left None: the model's ``pooler_config``, by default
        the last position's, L2-normalised). Prompts are those of ``generate``: text, token
        ids, with media (``multi_modal_data``) or prompt embeddings. ``truncate_prompt_tokens``
        (or ``pooling_params``'): pool only each prompt's last k tokens (-1: max_model_len)."""
        params = embedding_params(_with_task(pooling_params, "embed", truncate_prompt_tokens))
        outputs = self.generate(prompts, params, use_tqdm, lora_request=lora_request)
        return [EmbeddingRequestOutput.from_output(output) for output in outputs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities by a sequence classifier
        (``*ForSequenceClassification``), in prompt order: its head on the prompt's pooled
        final state (softmax; sigmoid for one label; raw scores with ``use_activation=False``);
        ``truncate_prompt_tokens`` as ``embed``'s."""
        params = embedding_params(_with_task(pooling_params, "classify", truncate_prompt_tokens))
        outputs = self.generate(prompts, params, use_tqdm, lora_request=lora_request)
        return [ClassificationRequestOutput.from_output(output) for output in outputs]

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        use_tqdm: UseTqdm = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        chat_template: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's bi-encoder scoring: the cosine similarity of each pair's embeddings
        (``embed``'s, with ``pooling_params``), pairing one ``data_1`` prompt with each of
        ``data_2`` (1:1, 1:N) or the i-th with the i-th (N:N); one output per pair. A one-label
        sequence classifier (a cross-encoder reranker) instead classifies each pair's prompts
        joined end to end (texts, or token ids; with ``chat_template``, vLLM's score template,
        the texts as it renders a "query" and a "document" message), its probability the
        score."""
        firsts, seconds = _prompt_list(data_1, "data_1"), _prompt_list(data_2, "data_2")
        pairs = score_pairs(len(firsts), len(seconds))
        if self.llm_engine.config.model_config.cross_encodes():
            joined = [self._pair_prompt(firsts[i], seconds[j], chat_template) for i, j in pairs]
            classified = self.classify(joined, pooling_params, use_tqdm, lora_request,
                                       truncate_prompt_tokens)  # fmt: skip
            return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.probs[0]),
                                         o.prompt_token_ids) for o in classified]  # fmt: skip
        embedded = self.embed(firsts + seconds, pooling_params, use_tqdm, lora_request,
                              truncate_prompt_tokens)  # fmt: skip
        return [
            ScoringRequestOutput.from_embeddings(embedded[i], embedded[len(firsts) + j])
            for i, j in pairs
        ]

    def _pair_prompt(
        self, first: PromptType, second: PromptType, chat_template: str | None
    ) -> PromptType:
        """A cross-encoder's prompt of a pair: two texts as ``score_pair_text`` makes it, or
        two token prompts end to end (without a score template)."""
        if isinstance(first, str) and isinstance(second, str):
            return score_pair_text(self.get_tokenizer(), first, second, chat_template)
        if (
            chat_template is None
            and isinstance(first, dict)
            and isinstance(second, dict)
            and {"prompt_token_ids"} == set(first) == set(second)
        ):
            ids = [*first["prompt_token_ids"], *second["prompt_token_ids"]]  # type: ignore[typeddict-item]
            return TokensPrompt(prompt_token_ids=ids)
        raise TypeError(
            "A cross-encoder scores pairs of texts, or of token prompts ({'prompt_token_ids': "
            "...}) without a score template; media and prompt embeddings are not joined."
        )

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
        use_tqdm: UseTqdm = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Each prompt's best ``params.beam_width`` answers by beam search (``beam_search``
        says how), best first; prompts may carry media as in ``generate``. As in vLLM,
        ``concurrency_limit`` prompts are searched at a time (None: all) and ``use_tqdm``
        shows a bar of the steps."""
        prompts = _prompt_list(prompts)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, not {type(params).__name__}.")
        make_bar = _progress_bar(use_tqdm)
        if concurrency_limit is None:
            concurrency_limit = max(len(prompts), 1)
        if not isinstance(concurrency_limit, int) or isinstance(concurrency_limit, bool):
            raise TypeError(f"concurrency_limit must be an int or None, not "
                            f"{type(concurrency_limit).__name__}.")  # fmt: skip
        if concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}.")
        params.check_width(self.llm_engine.config.model_config.max_logprobs)
        tokenizer = self.get_tokenizer()
        bases = [_token_prompt(prompt, tokenizer) for prompt in prompts]
        decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
        chunks = range(0, len(bases), concurrency_limit)
        results: list[BeamSearchOutput] = []
        bar = make_bar(total=len(chunks) * params.max_tokens, desc="Beam search",
                       dynamic_ncols=True)  # fmt: skip
        try:
            for start in chunks:
                batch = self._search(bases[start : start + concurrency_limit], params,
                                     lora_request, bar)  # fmt: skip
                results += [BeamSearchOutput(beams) for beams in batch.results(decode)]
        finally:
            bar.close()
        return results

    def _search(
        self, bases: list[dict[str, Any]], params: BeamSearchParams,
        lora_request: LoRARequest | None, bar: tqdm,
    ) -> BeamSearchBatch:  # fmt: skip
        """Beam search over ``bases`` to the end, a step of ``bar`` per token (all of
        ``max_tokens`` when the beams end sooner)."""
        engine = self.llm_engine
        batch = BeamSearchBatch(len(bases), params, engine.processor.eos_token_ids,
                                engine.config.model_config.max_model_len)  # fmt: skip
        steps = 0
        while not batch.done:
            step_prompts: list[Any] = [
                {**bases[i], "prompt_token_ids": bases[i]["prompt_token_ids"] + beam.tokens}
                for i, beam in batch.step_beams()
            ]
            batch.take_step(self.generate(step_prompts, params.step_params(), use_tqdm=False,
                                          lora_request=lora_request))  # fmt: skip
            bar.update(1)
            steps += 1
        bar.update(max(params.max_tokens - steps, 0))
        return batch

    def _add_requests(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priorities: list[int],
        loras: list[LoRARequest | None],
    ) -> list[str]:
        request_ids: list[str] = []
        # Only finished outputs are returned, whole (vLLM's LLM does the same): a cumulative
        # request would rebuild its output every step for nothing, and a delta request's last
        # output would hold only its last piece.
        final_only: dict[int, SamplingParams] = {}
        try:
            with self.llm_engine.batched_adds():
                for prompt, param, priority, lora in zip(
                    prompts, params, priorities, loras, strict=True
                ):
                    if param.output_kind != RequestOutputKind.FINAL_ONLY:
                        if id(param) not in final_only:
                            final_only[id(param)] = param.clone(
                                output_kind=RequestOutputKind.FINAL_ONLY
                            )
                        param = final_only[id(param)]
                    request_id = str(next(self._request_counter))
                    self.llm_engine.add_request(
                        request_id, prompt, param, priority=priority, lora_request=lora
                    )
                    request_ids.append(request_id)
        except Exception:
            # One bad prompt rejects the call; leave the engine clean for the next one.
            self.llm_engine.abort_request(request_ids)
            raise
        return request_ids

    def _run_engine(
        self, request_ids: list[str], make_bar: Callable[..., tqdm]
    ) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        try:
            bar = make_bar(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
            try:  # a bar needs only update and close (vLLM's use)
                while self.llm_engine.has_unfinished_requests():
                    for output in self.llm_engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
            finally:
                bar.close()
        except BaseException:
            # Ctrl-C, an engine failure or a bar that fails: leave no request running.
            self.llm_engine.abort_request([r for r in request_ids if r not in finished])
            raise
        return [finished[r] for r in request_ids]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into the engine now (requests naming it otherwise do, once)."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def reset_mm_cache(self) -> None:
        """Forget processed media and cached encoder outputs (vLLM's ``reset_mm_cache``)."""
        self.llm_engine.reset_mm_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (needs ``enable_sleep_mode=True``), with no request unfinished:
        level 1 releases the KV cache (on a GPU the weights too), level 2 the weights as well;
        requests are refused until ``wake_up``, which reads the weights again."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released: ``tags`` "weights" and/or "kv_cache" (None: both;
        waking the weights alone leaves the KV cache for a later ``wake_up``)."""
        self.llm_engine.wake_up(tags)

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` of every worker (a ``Worker`` method, e.g. ``reload_weights``, or
        one of ``worker_extension_cls``) and return their results by rank (vLLM's; methods by
        name, arguments and results as msgpack carries them, tensors included)."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def start_profile(self) -> None:
        """Start the torch profiler in every worker (needs ``OMNISERVE_TORCH_PROFILER_DIR``)."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        """Stop it: each worker writes its trace and ``profiler_out_<rank>.txt`` there."""
        self.llm_engine.stop_profile()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()


def _token_prompt(prompt: PromptType, tokenizer: Any) -> dict[str, Any]:
    """A prompt as token ids (with its media, if any), which each beam extends."""
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    if not isinstance(prompt, dict):
        raise TypeError(f"A prompt must be a str or a dict, got {type(prompt).__name__}.")
    if "prompt_embeds" in prompt:
        raise ValueError("Beam search extends token ids; a prompt given as prompt_embeds has none.")
    base = {k: v for k, v in prompt.items() if k != "prompt"}
    if base.get("prompt_token_ids") is not None:
        base["prompt_token_ids"] = checked_token_ids(base["prompt_token_ids"])  # beams extend it
        return base
    text = prompt.get("prompt")
    if not isinstance(text, str):
        raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
    base["prompt_token_ids"] = list(tokenizer(text).input_ids)
    return base


def _prompt_list(
    prompts: PromptType | Sequence[PromptType], name: str = "prompts"
) -> list[PromptType]:
    """One prompt (text, or a prompt dict) or several, as a list; ``TypeError`` naming
    ``name`` for anything else."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(
            f"{name} must be a prompt (text, or a dict with prompt or prompt_token_ids) or "
            f"a list of them, not {type(prompts).__name__}."
        )
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, dict)):
            raise TypeError(
                f"{name}[{i}] must be text or a dict with prompt or prompt_token_ids, "
                f"not {type(prompt).__name__}."
            )
    return list(prompts)


def _progress_bar(use_tqdm: UseTqdm) -> Callable[..., tqdm]:
    """What builds ``_run_engine``'s progress bar: ``use_tqdm`` itself if callable, else
    ``tqdm``, hidden for False."""
    if callable(use_tqdm):
        return use_tqdm
    if use_tqdm is None:
        use_tqdm = False
    if not isinstance(use_tqdm, bool):
        raise TypeError(
            "use_tqdm must be a bool or a callable building the progress bar in place of tqdm, "
            f"not {type(use_tqdm).__name__}."
        )
    return functools.partial(tqdm, disable=not use_tqdm)


def _per_prompt(
    value: Any, num_prompts: int, name: str, kinds: type | tuple[type, ...], what: str, noun: str
) -> list[Any]:
    """``value`` for each prompt: one for all, or a list (or tuple) with one per prompt, each
    ``what`` (of ``kinds``; a bool is not an int here); ``TypeError`` naming ``name`` (and the
    item) otherwise."""
    many = isinstance(value, list | tuple)
    for i, item in enumerate(value if many else [value]):
        if isinstance(item, bool) or not isinstance(item, kinds):
            got = type(item).__name__
            if many:
                raise TypeError(f"{name}[{i}] must be {what}, not {got}.")
            raise TypeError(f"{name} must be {what} or a list of one per prompt, not {got}.")
    if not many:
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise ValueError(f"Got {len(value)} {noun} for {num_prompts} prompts.")
    return list(value)


def _with_task(
    pooling_params: PoolingParams | None, task: str | None, truncate_prompt_tokens: int | None
) -> PoolingParams:
    """``pooling_params`` (None: the model's defaults) for ``task`` (None: the params' own) and
    with the call's ``truncate_prompt_tokens``, neither of which it may contradict."""
    if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
        raise TypeError(
            f"pooling_params must be a PoolingParams, not {type(pooling_params).__name__}."
        )
    params = pooling_params or PoolingParams()
    if task is not None and params.task not in (None, task):
        raise ValueError(f"pooling_params.task is {params.task!r}; this call runs {task!r}.")
    keep = params.truncate_prompt_tokens
    if truncate_prompt_tokens is not None and keep not in (None, truncate_prompt_tokens):
        raise ValueError(f"pooling_params.truncate_prompt_tokens is {keep}; this call's "
                         f"truncate_prompt_tokens is {truncate_prompt_tokens}.")  # fmt: skip
    if truncate_prompt_tokens is not None:
        params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
    return params if task is None else dataclasses.replace(params, task=task)
