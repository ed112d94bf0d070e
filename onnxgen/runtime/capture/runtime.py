"""The capture runtime: a step run as recorded segments and eager seams, per binding key.

``CaptureRuntime.run(feeds)`` is a drop-in for ``GraphProgram.run`` on the decode step. Per binding
key (the values of every non-growing symbol of the graph inputs: batch, query length, and the KV
capacity when the caller pins it) it plans the step, and a ``CapturedProgram`` walks the phases
(DESIGN.md "Capture contract"):

  warm-up (eager, N steps) -> armed (record) -> ready (replay) | unsupported (eager, with a reason)

Before every replay each segment's bindings are checked against their recorded signature; a
mismatch never replays (the segment runs eagerly, the key re-records next step, an invalidation
is counted). A recording that fails quarantines the op type, re-plans, and the step completes
eagerly. ``mode="verify"`` runs the first N captured steps eagerly too and raises on any bit
difference.

Replayed outputs are persistent buffers: they stay valid until the next run of the same key.
Segments run twice when recorded (the recorder's warm-up or recording run, then a replay), so a
segment must be a pure function of its bindings apart from idempotent in-place writes (the KV
rows an attention op writes into a static cache). A step tail (tail.py: greedy decode's next token,
position and mask row) is the exception, run once per step: recorded into the step's last segment
where that segment produces what it reads, else applied eagerly after the step. A key's recordings
belong to one tail (or none): ``run(feeds, tail=t)`` with another tail plans and records anew.
"""

from __future__ import annotations

import weakref
from collections import ChainMap
from collections.abc import Mapping
from typing import Any

import onnx
import torch

from onnxgen.errors import InvalidInputError, OnnxgenError
from onnxgen.runtime.capture.bindings import Binding, Guard, Signature
from onnxgen.runtime.capture.classifier import classify
from onnxgen.runtime.capture.planner import CapturePlan, plan_capture
from onnxgen.runtime.capture.recorder import CudaGraphRecorder, Recorder, Recording, RecordingFailed, SegmentFn
from onnxgen.runtime.capture.report import decode_binding
from onnxgen.runtime.capture.segments import ScheduleRefused, Unit, build_schedule
from onnxgen.runtime.capture.stats import CaptureStats
from onnxgen.runtime.capture.tail import StepTail
from onnxgen.runtime.executor import GraphProgram, NodeRunner
from onnxgen.runtime.shapes.infer import ShapeResult, infer_shapes

MODES = ("on", "off", "verify")
WARMUP, ARMED, READY, UNSUPPORTED = "warm-up", "armed", "ready", "unsupported"
Key = tuple[tuple[str, int], ...]
Slot = tuple[Key, int]  # a binding key and the id of the step tail its recordings hold (0: none)


def slot_of(key: Key, tail: StepTail | None) -> Slot:
    return key, id(tail) if tail is not None else 0


class CaptureMismatchError(OnnxgenError):
    """verify mode: a captured step's output differs from the eager step's."""


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _values(env: Mapping[str, Any], names: list[str]) -> list[Any]:
    """``[env[n] for n in names]``; a ChainMap's first map (the step's feeds and outputs) is read
    directly, as ChainMap.__getitem__ would, without its Python-level lookup per name."""
    if isinstance(env, ChainMap):
        first = env.maps[0]
        return [first[n] if n in first else env[n] for n in names]
    return [env[n] for n in names]


def key_label(key: Key) -> str:
    return ",".join(f"{k}={v}" for k, v in key) or "(no symbols)"


class CapturedProgram:
    """One binding key: its schedule, bindings, recordings and phase."""

    def __init__(
        self,
        program: GraphProgram,
        plan: CapturePlan,
        shapes: ShapeResult,
        recorder: Recorder,
        key: Key,
        *,
        warmup_steps: int = 2,
        max_rerecords: int = 3,
        guard: bool = True,
        tail: StepTail | None = None,
    ):
        self.program = program
        self.plan = plan
        self.key = key
        self.tail = tail
        self.slot = slot_of(key, tail)
        self.recorder = recorder
        self.schedule = build_schedule(program, plan, shapes)  # may raise ScheduleRefused
        self.device = program.device
        self.warmup_steps = max(1, warmup_steps)
        self.max_rerecords = max_rerecords
        self.guard = guard  # False only in tests: shows what verify catches without the guard
        self.phase = WARMUP if self.schedule.segments else UNSUPPORTED
        self.reason: str | None = None if self.schedule.segments else "the plan has no segment"
        self.warm_runs = 0
        self.rerecords = 0
        self.static_values: dict[str, Any] | None = None
        self.device_copies: dict[str, Any] = {}
        self.runner = NodeRunner(self.device, program.host_copies)  # device copies join after warm-up
        self.recordings: dict[int, Recording] = {}
        self.bindings: dict[int, dict[str, Binding]] = {}
        self.guards: dict[int, Guard] = {}
        self.last_feeds: dict[str, weakref.ref] = {}
        # the unit the tail is recorded into: the last one, if it is a segment that makes what the tail reads
        self.tail_unit: int | None = None
        self.tail_reason: str | None = None
        if tail is not None:
            self.tail_unit, self.tail_reason = self._tail_unit(tail)
        self.tail_ran = False  # whether the most recent run() ran the tail (in a replay)

    def _tail_unit(self, tail: StepTail) -> tuple[int | None, str | None]:
        units = self.schedule.units
        if not units or units[-1].kind != "segment":
            return None, "the step ends in an eager seam"
        missing = [n for n in tail.reads if n not in units[-1].outputs]
        if missing:
            return None, f"the step's last segment does not make {', '.join(missing)}"
        return len(units) - 1, None

    # -- the signature every replay is guarded by -------------------------------------------

    def signature(self) -> list[tuple[str, Signature]]:
        return [(n, b.recorded) for i in sorted(self.bindings) for n, b in self.bindings[i].items()]

    def unsupported(self, reason: str) -> None:
        self.phase, self.reason = UNSUPPORTED, reason
        self.recordings, self.bindings, self.guards = {}, {}, {}

    # -- one step ----------------------------------------------------------------------------

    def run(self, feeds: Mapping[str, Any], stats: CaptureStats) -> tuple[Mapping[str, Any], bool]:
        """Run one step; returns the values and whether any segment was recorded or replayed
        (``tail_ran`` then says whether a replay ran the step tail)."""
        self.tail_ran = False
        result = self._run_phase(feeds, stats)
        # feeds the caller hands again, the same tensor unchanged (StaticKV buffers and mask), are
        # used in place by the recording; only the step right before one needs remembering (every
        # step used to pay for this). Weak references: an equal address alone may be a reused allocation
        if self.phase == ARMED:
            self.last_feeds = {n: weakref.ref(v) for n, v in feeds.items() if isinstance(v, torch.Tensor)}
        elif self.last_feeds:
            self.last_feeds = {}
        return result

    def _run_phase(self, feeds: Mapping[str, Any], stats: CaptureStats) -> tuple[Mapping[str, Any], bool]:
        if self.phase == UNSUPPORTED:
            return self.program.run(feeds), False
        if self.phase == WARMUP:
            env = self._warm(feeds)
            self.warm_runs += 1
            if self.warm_runs >= self.warmup_steps:
                self.phase = ARMED
            return env, False
        if self.phase == ARMED:
            last = self.last_feeds
            persistent = {n for n, v in feeds.items() if n in last and last[n]() is v}
            return self._record(feeds, persistent, stats), True
        return self._replay(feeds, stats), True

    def _env(self, feeds: Mapping[str, Any]) -> ChainMap:
        return ChainMap(dict(feeds), self.static_values or {}, self.program.initializers)

    def _warm(self, feeds: Mapping[str, Any]) -> Mapping[str, Any]:
        if self.static_values is not None:
            return self.program.run(feeds)
        env = ChainMap(dict(feeds), self.program.initializers)
        run, own = self.runner.run, env.maps[0]  # outputs go into env's first map, as assigning to env does
        with self.program.unit():
            for node in self.program.nodes:
                run(node, env, own)
        # static shape arithmetic: constants for this key from now on
        self.static_values = {n: env.maps[0][n] for n in self.schedule.static_outputs if n in env.maps[0]}
        if self.device.type != "cpu":
            self.device_copies = {
                n: v.to(self.device)
                for n, v in self.static_values.items()
                if isinstance(v, torch.Tensor) and v.device.type == "cpu"
            }
            self.runner = NodeRunner(self.device, self.program.host_copies, self.device_copies)
        return env

    def _run_unit_eagerly(self, unit: Unit, env: ChainMap) -> None:
        run, own = self.runner.run, env.maps[0]
        with self.program.unit():
            for node in unit.nodes:
                run(node, env, own)

    def _segment_fn(self, unit: Unit, bindings: dict[str, Binding], tail: StepTail | None = None) -> SegmentFn:
        frozen: list[dict[int, Any]] = [{} for _ in unit.nodes]
        inputs = {n: b.tensor for n, b in bindings.items()}
        static = self.static_values or {}
        initializers = self.program.initializers

        def fn(replay: bool, commit: bool) -> dict[str, Any]:
            local: dict[str, Any] = {}
            env = ChainMap(local, inputs, static, initializers)
            run = self.runner.run
            with self.program.unit():  # inside the recording: it joins every stream the segment forked
                for i, node in enumerate(unit.nodes):
                    try:
                        if replay:
                            run(node, env, local, frozen=frozen[i])
                        else:
                            run(node, env, local, freeze=frozen[i])
                    except RecordingFailed:
                        raise
                    except Exception as exc:
                        if replay:
                            raise
                        raise RecordingFailed(
                            f"{unit.label}: {node.ctx.op_type} {node.ctx.name!r}: {exc}",
                            node.ctx.op_type,
                            node.ctx.name,
                        ) from exc
            if tail is not None and commit:
                try:
                    tail.apply(local, tail.state())
                except Exception as exc:
                    if replay:
                        raise
                    raise RecordingFailed(f"{unit.label}: the step tail: {exc}", None) from exc
            return {n: local[n] for n in unit.outputs}

        # the recorder tells fresh outputs from views of bindings and constants (weights, shapes)
        storages = {_storage(b.tensor) for b in bindings.values()}
        storages.update(_storage(v) for v in (*static.values(), *initializers.values()) if isinstance(v, torch.Tensor))
        fn.input_storages = storages  # type: ignore[attr-defined]
        return fn

    def _record(self, feeds: Mapping[str, Any], persistent: set[str], stats: CaptureStats) -> Mapping[str, Any]:
        self.recordings, self.bindings, self.guards = {}, {}, {}
        self.recorder.begin_key()
        env = self._env(feeds)
        recorded: dict[str, torch.Tensor] = {}  # outputs of segments recorded so far
        for i, unit in enumerate(self.schedule.units):
            if unit.kind != "segment":
                self._run_unit_eagerly(unit, env)
                continue
            bindings: dict[str, Binding] = {}
            for name in unit.inputs:
                value = env[name]
                if not isinstance(value, torch.Tensor):
                    raise RecordingFailed(f"{unit.label}: input {name!r} is not a tensor", None)
                stable = name in persistent or recorded.get(name) is value
                if stable and value.device == self.device:
                    bindings[name] = Binding.adopt(name, value)
                else:
                    bindings[name] = Binding.own(name, value, self.device)
            tail = self.tail if i == self.tail_unit else None
            recording = self.recorder.record(self._segment_fn(unit, bindings, tail), unit.label)
            recording.replay()  # a CUDA capture does not execute: the replay computes this step
            self.tail_ran = self.tail_ran or tail is not None
            stats.captures += 1
            self.recordings[i], self.bindings[i], self.guards[i] = recording, bindings, Guard(bindings)
            for name, value in recording.outputs.items():
                env[name] = value
                recorded[name] = value
        self.phase = READY
        return env

    def _replay(self, feeds: Mapping[str, Any], stats: CaptureStats) -> Mapping[str, Any]:
        env = self._env(feeds)
        invalid: str | None = None
        for i, unit in enumerate(self.schedule.units):
            if unit.kind != "segment":
                self._run_unit_eagerly(unit, env)
                continue
            guard = self.guards[i]
            values = _values(env, guard.names)
            why = guard.mismatch(values) if self.guard else None
            if why is not None:  # never replay on a mismatch: this segment runs eagerly
                stats.invalidations += 1
                stats.invalidation_reasons[why.split(" (")[0]] += 1
                invalid = why
                self._run_unit_eagerly(unit, env)
                continue
            for k in guard.owned:  # adopted bindings are used in place: nothing to write
                guard.bindings[k].write(values[k])
            recording = self.recordings[i]
            recording.replay()
            self.tail_ran = self.tail_ran or i == self.tail_unit
            stats.replays += 1
            for name, value in recording.outputs.items():
                env[name] = value
        if invalid is None:
            self.rerecords = 0
        else:
            self.rerecords += 1
            self.phase = ARMED
            if self.rerecords > self.max_rerecords:
                self.unsupported(f"binding signature keeps changing ({invalid})")
        return env


class EagerKey:
    """A key that runs eagerly from the start (its planning failed)."""

    plan = None
    tail: StepTail | None = None
    tail_ran = False

    def __init__(self, program: GraphProgram, key: Key, reason: str, slot: Slot):
        self.program, self.key, self.reason, self.phase, self.slot = program, key, reason, UNSUPPORTED, slot

    def unsupported(self, reason: str) -> None:
        self.reason = reason

    def run(self, feeds: Mapping[str, Any], stats: CaptureStats) -> tuple[Mapping[str, Any], bool]:
        return self.program.run(feeds), False


class CaptureRuntime:
    """Captured execution of one program's decode step, for every binding key it meets."""

    def __init__(
        self,
        program: GraphProgram,
        model: onnx.ModelProto,
        *,
        mode: str = "on",
        recorder: Recorder | None = None,
        pin: tuple[str, ...] | set[str] = (),
        warmup_steps: int = 2,
        verify_steps: int = 8,
        classifier_mode: str = "failsafe",
        min_segment_nodes: int = 2,
        max_rerecords: int = 3,
        guard: bool = True,
    ):
        if mode not in MODES:
            raise InvalidInputError(f"capture must be one of {', '.join(MODES)}, got {mode!r}")
        if recorder is None and mode != "off":
            if program.device.type != "cuda":
                raise InvalidInputError(
                    "CUDA graph capture needs a CUDA device; use capture='off' on the CPU "
                    "(tests pass recorder=ReplayRecorder())"
                )
            recorder = CudaGraphRecorder(program.device)
        self.program = program
        self.model = model
        self.mode = mode
        self.recorder = recorder
        self.pin = set(pin)
        self.options = dict(warmup_steps=warmup_steps, max_rerecords=max_rerecords, guard=guard)
        self.verify_steps = verify_steps
        self.classifier_mode = classifier_mode
        self.min_segment_nodes = min_segment_nodes
        self.opsets = {("" if o.domain in ("", "ai.onnx") else o.domain): o.version for o in model.opset_import}
        self.quarantine: dict[str, str] = {}
        self.keys: dict[Slot, CapturedProgram | EagerKey] = {}
        self.stats = CaptureStats(mode=mode)
        inits = set(program.initializers)
        self.inputs = [vi for vi in program.inputs if vi.name not in inits]
        self.output_names = [o.name for o in program.outputs]
        decode = infer_shapes(model, decode_binding(model))
        growing = classify(decode, mode=classifier_mode).growing
        # the symbols a key leaves free: growing ones the caller did not pin (the KV length)
        self.free = {d for vi in self.inputs for d in vi.shape or () if isinstance(d, str) and d in growing}
        self.free -= self.pin
        # per input: its rank and the (axis, symbol) pairs that make the key, worked out once (key_of
        # runs every step; walking every input's full shape there was a visible part of a step's host time)
        self.key_axes: list[tuple[str, int, tuple[tuple[int, str], ...]]] = []
        for vi in self.inputs:
            if vi.shape is None:
                continue
            axes = tuple((a, d) for a, d in enumerate(vi.shape) if isinstance(d, str) and d and d not in self.free)
            if axes:
                self.key_axes.append((vi.name, len(vi.shape), axes))

    # -- keys and plans ----------------------------------------------------------------------

    def key_of(self, feeds: Mapping[str, Any]) -> Key:
        bind: dict[str, int] = {}
        for name, rank, axes in self.key_axes:  # in input order: a later input's value wins, as before
            value = feeds.get(name)
            if not isinstance(value, torch.Tensor):
                continue
            shape = value.shape
            if len(shape) != rank:
                continue
            for axis, d in axes:
                bind[d] = shape[axis]
        return tuple(sorted(bind.items()))

    def plan_for(self, key: Key) -> tuple[CapturePlan, ShapeResult]:
        shapes = infer_shapes(self.model, dict(key))
        cls = classify(shapes, mode=self.classifier_mode)
        plan = plan_capture(
            shapes, cls, self.opsets, quarantine=tuple(self.quarantine), min_segment_nodes=self.min_segment_nodes
        )
        return plan, shapes

    def _build(self, key: Key, tail: StepTail | None = None) -> CapturedProgram | EagerKey:
        assert self.recorder is not None
        slot = slot_of(key, tail)
        for _ in range(64):  # each refusal quarantines one more op type
            try:
                plan, shapes = self.plan_for(key)
                captured = CapturedProgram(self.program, plan, shapes, self.recorder, key, tail=tail, **self.options)
            except ScheduleRefused as exc:
                self._quarantine(exc.op_type, str(exc))
                continue
            except Exception as exc:  # planning must never take the generation down: run eagerly
                return self._eager_key(slot, f"planning failed: {type(exc).__name__}: {exc}")
            self.stats.note_plan(len(plan.segments), [n.reason or "" for n in plan.seams])
            if captured.phase == UNSUPPORTED:
                self.stats.unsupported[key_label(key)] = captured.reason or ""
            if tail is not None:
                self.stats.tail = "in the graph" if captured.tail_reason is None else f"eager: {captured.tail_reason}"
            self.keys[slot] = captured
            return captured
        return self._eager_key(slot, "capture planning did not settle")

    def _eager_key(self, slot: Slot, reason: str) -> EagerKey:
        key = slot[0]
        self.stats.unsupported[key_label(key)] = reason
        eager = self.keys[slot] = EagerKey(self.program, key, reason, slot)
        return eager

    def _quarantine(self, op_type: str, why: str) -> None:
        self.quarantine[op_type] = why
        self.stats.quarantined[op_type] = why

    def captured(self, feeds: Mapping[str, Any], tail: StepTail | None = None) -> CapturedProgram | EagerKey:
        key = self.key_of(feeds)
        found = self.keys.get(slot_of(key, tail))
        if found is None:
            self.stats.keys += 1
            found = self._build(key, tail)
        return found

    # -- running -----------------------------------------------------------------------------

    def run(self, feeds: Mapping[str, Any], tail: StepTail | None = None) -> dict[str, Any]:
        """Run one step; returns every graph output. ``tail``: work run once after the step that
        advances state the next step reads (tail.py), recorded into the step's graph where it can be."""
        names = self.output_names
        self.stats.steps += 1
        if self.mode == "off":
            self.stats.eager_steps += 1
            env = self.program.run(feeds)
            out = {n: env[n] for n in names}
            if tail is not None:
                tail.apply(out, tail.state())
            return out
        captured = self.captured(feeds, tail)
        checking = (
            self.mode == "verify" and self.stats.verified_steps < self.verify_steps and captured.phase in (ARMED, READY)
        )
        reference: dict[str, Any] | None = None
        reference_state: dict[str, torch.Tensor] = {}
        if checking:
            # eager on copies first: in-place KV writes must not reach the captured run's inputs
            copies = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in feeds.items()}
            env = self.program.run(copies)
            reference = {n: env[n] for n in names}
            if tail is not None:
                reference_state = {k: v.clone() for k, v in tail.state().items()}
                tail.apply(reference, reference_state)
        env, tail_ran = self._run_captured(captured, feeds)
        out = dict(zip(names, _values(env, names)))
        if tail is not None and not tail_ran:
            tail.apply(out, tail.state())
        if reference is not None:
            self._compare(reference, out, captured)
            if tail is not None:
                self._compare(reference_state, tail.state(), captured, what="step tail state")
            self.stats.verified_steps += 1
        return out

    def _run_captured(
        self, captured: CapturedProgram | EagerKey, feeds: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], bool]:
        """The step's values, and whether a replay ran the step tail."""
        try:
            env, used = captured.run(feeds, self.stats)
        except RecordingFailed as exc:
            # abort: drop this key's recordings, quarantine the op, re-plan; the step runs eagerly
            self.stats.recording_failures += 1
            del self.keys[captured.slot]
            if exc.op_type is None:
                captured.unsupported(f"recording failed: {exc}")
                self.keys[captured.slot] = captured
                self.stats.unsupported[key_label(captured.key)] = captured.reason or ""
            else:
                self._quarantine(exc.op_type, f"broke a recording: {exc}")
                captured = self._build(captured.key, captured.tail)
            env, used = captured.run(feeds, self.stats)  # eager: the new program's first warm-up step
        if used:
            self.stats.captured_steps += 1
        else:
            self.stats.eager_steps += 1
        return env, captured.tail_ran

    def _compare(
        self,
        reference: Mapping[str, Any],
        out: Mapping[str, Any],
        captured: CapturedProgram | EagerKey,
        what: str = "output(s)",
    ) -> None:
        bad = []
        for name, want in reference.items():
            got = out[name]
            if isinstance(want, torch.Tensor):
                same = (
                    isinstance(got, torch.Tensor)
                    and got.shape == want.shape
                    and got.dtype == want.dtype
                    and torch.equal(got, want)
                )
                if not same:
                    detail = f"shape {list(want.shape)} vs {list(got.shape)}"
                    if isinstance(got, torch.Tensor) and got.shape == want.shape and want.is_floating_point():
                        detail = f"max |diff| {(got.double() - want.double()).abs().max().item():.3g}"
                    bad.append(f"{name} ({detail})")
        if bad:
            raise CaptureMismatchError(
                f"capture verify: step {self.stats.steps} (key {key_label(captured.key)}, phase before the step "
                f"{captured.phase}) differs from eager in {len(bad)} {what}: {', '.join(bad[:8])}"
            )
