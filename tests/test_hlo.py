"""Reading HLO modules: loop trip counts with and without XLA's annotation, async shapes, and the TPU compiler's ways
of doing one collective with another (all-reduce-scatter fusions, windowed einsums), on small modules written the
way the compilers print them. The same patterns in real compiled TPU and GPU steps: tests/test_hlo_tpu.py."""

import pytest

from jaxtrain.analysis.hlo import collectives, loop_multiplicity, parse_module, trip_count

# A scanned layer stack as the TPU compiler prints it: no known_trip_count; the counter is element 0 of the loop
# state, started from a copied constant, stepped by the body and compared with a constant by the condition.
LOOP = """HloModule jit_traced, is_scheduled=true, num_partitions=8

%body (wide.param.3: (s32[], bf16[1,32,768])) -> (s32[], bf16[1,32,768]) {
  %wide.param.3 = (s32[]{:T(128)}, bf16[1,32,768]{2,1,0:T(8,128)(2,1)}) parameter(0)
  %get-tuple-element.3536 = s32[]{:T(128)} get-tuple-element(%wide.param.3), index=0
  %get-tuple-element.1 = bf16[1,32,768]{2,1,0:T(8,128)(2,1)} get-tuple-element(%wide.param.3), index=1
  %all-gather.71 = bf16[8,32,768]{2,1,0:T(8,128)(2,1)} all-gather(%get-tuple-element.1), channel_id=1, \
replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  %constant.425 = s32[]{:T(128)} constant(STEP)
  %add.536 = s32[]{:T(128)} ADD(%get-tuple-element.3536, %constant.425)
  ROOT %tuple.230 = (s32[]{:T(128)}, bf16[1,32,768]{2,1,0:T(8,128)(2,1)}) tuple(%add.536, %get-tuple-element.1)
}

%cond (wide.param.2: (s32[], bf16[1,32,768])) -> pred[] {
  %constant.381 = s32[]{:T(128)} constant(BOUND)
  %wide.param.2 = (s32[]{:T(128)}, bf16[1,32,768]{2,1,0:T(8,128)(2,1)}) parameter(0)
  %get-tuple-element.3280 = s32[]{:T(128)} get-tuple-element(%wide.param.2), index=0
  ROOT %lt.53 = pred[]{:T(512)} compare(%get-tuple-element.3280, %constant.381), direction=DIRECTION
}

ENTRY %main (p: bf16[1,32,768]) -> bf16[1,32,768] {
  %p = bf16[1,32,768]{2,1,0:T(8,128)(2,1)} parameter(0)
  %constant.410 = s32[]{:T(128)} constant(START)
  %copy.202 = s32[]{:T(128)} copy(%constant.410)
  %tuple.228 = (s32[]{:T(128)}, bf16[1,32,768]{2,1,0:T(8,128)(2,1)}) tuple(%copy.202, %p)
  %while.101 = (s32[]{:T(128)}, bf16[1,32,768]{2,1,0:T(8,128)(2,1)}) while(%tuple.228), condition=%cond, \
body=%body, metadata={op_name="jit(traced)/jvp()/while"}BACKEND
  ROOT %out = bf16[1,32,768]{2,1,0:T(8,128)(2,1)} get-tuple-element(%while.101), index=1
}
""".replace("\\\n", "")


def loop(start=0, step=1, bound=12, direction="LT", add="add", backend=""):
    return (
        LOOP.replace("START", str(start))
        .replace("STEP", str(step))
        .replace("BOUND", str(bound))
        .replace("DIRECTION", direction)
        .replace("ADD", add)
        .replace("BACKEND", backend)
    )


@pytest.mark.parametrize(
    "counter,trips",
    [
        ({}, 12),  # 0, 1, ..., 11
        ({"start": 3}, 9),
        ({"step": 2, "bound": 8}, 4),  # a windowed einsum's counter: 0, 2, 4, 6
        ({"step": 5}, 3),  # 0, 5, 10
        ({"direction": "LE"}, 13),
        ({"direction": "NE"}, 12),
        ({"start": 11, "step": -1, "bound": 0, "direction": "GE"}, 12),  # counting down: 11, ..., 0
        ({"start": 11, "step": 1, "bound": 0, "direction": "GE", "add": "subtract"}, 12),
        ({"start": 20}, 0),
        ({"backend": ', backend_config={"known_trip_count":{"n":"7"}}'}, 7),  # XLA's annotation wins
    ],
)
def test_trip_count_is_read_from_the_loop_counter(counter, trips):
    text = loop(**counter)
    module = parse_module(text)
    (while_loop,) = [i for i in module.computations["main"].values() if i.opcode == "while"]
    assert trip_count(module, "main", while_loop) == trips
    (gather,) = collectives(text)
    assert gather.executions == trips and gather.exact


def test_a_loop_whose_counter_is_not_constant_counts_once_and_says_so():
    text = loop().replace("%constant.381 = s32[]{:T(128)} constant(12)", "%constant.381 = s32[]{:T(128)} parameter(1)")
    (gather,) = collectives(text)
    assert gather.executions == 1 and not gather.exact
    runs, uncounted = loop_multiplicity(parse_module(text))
    assert runs["body"] == 1 and uncounted == {"body"}


def test_collectives_in_a_boolean_conditional_run_with_the_loop_around_it():
    # The GPU compiler prints a two-way conditional (a pipeline tick's branch) with true_/false_computation.
    branch = """
%on_true (t: bf16[1,32,768]) -> bf16[1,32,768] {
  %t = bf16[1,32,768]{2,1,0} parameter(0)
  ROOT %all-reduce.9 = bf16[1,32,768]{2,1,0} all-reduce(%t), channel_id=9, replica_groups=[4,2]<=[8], \
use_global_device_ids=true, to_apply=%add
}

%on_false (f: bf16[1,32,768]) -> bf16[1,32,768] {
  ROOT %f = bf16[1,32,768]{2,1,0} parameter(0)
}
""".replace("\\\n", "")
    text = loop().replace(
        "  %constant.425",
        "  %pred.1 = pred[] constant(true)\n  %conditional.1 = bf16[1,32,768]{2,1,0} conditional(%pred.1, "
        "%get-tuple-element.1, %get-tuple-element.1), true_computation=%on_true, false_computation=%on_false\n"
        "  %constant.425",
    )
    text = text.replace("\n%cond ", branch + "\n%cond ")
    reduce = next(c for c in collectives(text) if c.kind == "all-reduce")
    assert reduce.executions == 12 and reduce.computation == "on_true"


def test_async_collectives_take_the_shapes_of_their_done():
    # The CUDA plugin's all-reduce-start returns (operands, results); the -done holds the results alone.
    text = """HloModule m, num_partitions=8

ENTRY %main (p: f32[6]) -> f32[6] {
  %p = f32[6]{0} parameter(0)
  %all-reduce-start = ((f32[6]{0}), f32[6]{0}) all-reduce-start(%p), channel_id=20, \
replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %all-reduce-done = f32[6]{0} all-reduce-done(%all-reduce-start)
}
""".replace("\\\n", "")
    (reduce,) = collectives(text)
    assert reduce.kind == "all-reduce" and reduce.shapes == (("f32", (6,)),) and reduce.bytes == 24


# Trimmed from the TPU train step of gpt-tiny on data=2,fsdp=4 (v5p:2x2x2): the all-reduce of a weight's gradient
# fused with the dynamic-slices that keep each device's quarter.
ALL_REDUCE_SCATTER = """HloModule jit_traced, is_scheduled=true, num_partitions=8

%all-reduce-scatter.3 (input_0: f32[64,256]) -> f32[16,256] {
  %input_0 = f32[64,256]{1,0:T(8,128)} parameter(0)
  %all-reduce.11 = (f32[64,256]{1,0:T(8,128)}) all-reduce(%input_0), channel_id=1, \
replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add.4.clone
  %get-tuple-element.2684 = f32[64,256]{1,0:T(8,128)} get-tuple-element(%all-reduce.11), index=0
  %constant.1242 = u32[] constant(0)
  %partition-id.26 = u32[] partition-id()
  ROOT %dynamic-slice.355 = f32[16,256]{1,0:T(8,128)} dynamic-slice(%get-tuple-element.2684, %partition-id.26, \
%constant.1242), dynamic_slice_sizes={16,256}
}

ENTRY %main.42_spmd (p: f32[64,256]) -> f32[16,256] {
  %p = f32[64,256]{1,0:T(8,128)} parameter(0)
  ROOT %fusion.15 = f32[16,256]{1,0:T(8,128)} fusion(%p), kind=kCustom, calls=%all-reduce-scatter.3, \
metadata={op_name="jit(traced)/transpose(jvp(btd,dv->btv))/dot_general"}, \
backend_config={"collective_algorithm_config":{"emitter":"AllReduceScatterFusion"}}
}
""".replace("\\\n", "")


def test_an_all_reduce_scatter_fusion_is_a_reduce_scatter_of_the_shares():
    (scatter,) = collectives(ALL_REDUCE_SCATTER)
    assert (scatter.kind, scatter.via) == ("reduce-scatter", "all-reduce-scatter fusion")
    assert scatter.shapes == (("f32", (16, 256)),) and scatter.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert scatter.op_name == "jit(traced)/transpose(jvp(btd,dv->btv))/dot_general"  # the fusion's
    # An all-reduce whose result is used whole stays an all-reduce.
    whole = ALL_REDUCE_SCATTER.replace("ROOT %dynamic-slice.355 = f32[16,256]", "%dynamic-slice.355 = f32[16,256]")
    whole = whole.replace("  %constant.1242", "  ROOT %copy = f32[64,256]{1,0} copy(%get-tuple-element.2684)\n  %c")
    (reduce,) = collectives(whole)
    assert (reduce.kind, reduce.via, reduce.bytes) == ("all-reduce", "", 64 * 256 * 4)


# Trimmed from the TPU train step of gpt-tiny on fsdp=8 at batch 64, sequence 256 (v5p:2x2x2): the windowed einsum
# that multiplies by the gathered w_qkv. The loop passes two shards round the ring in opposite directions, two steps
# per trip; the permute before it gives the second buffer its first shard. A user's ppermute beside it stays one.
WINDOWED = """HloModule jit_traced, is_scheduled=true, num_partitions=8

%wide.windowed_dot_general_cond_ag.clone (wide.param.77: (bf16[1,8,3,4,16], bf16[1,8,3,4,16], u32[])) -> pred[] {
  %constant.1989 = u32[]{:T(128)} constant(4)
  %wide.param.77 = ($SHARD, $SHARD, u32[]{:T(128)}) parameter(0)
  %get-tuple-element.3380 = u32[]{:T(128)} get-tuple-element(%wide.param.77), index=2
  ROOT %compare.42 = pred[]{:T(512)} compare(%get-tuple-element.3380, %constant.1989), direction=LT
}

%wide.windowed_dot_general_body_ag.clone.sunk (wide.param.19: (bf16[1,8,3,4,16], bf16[1,8,3,4,16], \
u32[])) -> (bf16[1,8,3,4,16], bf16[1,8,3,4,16], u32[]) {
  %constant.2175..sunk.1..sunk = u32[]{:T(128)} constant(2)
  %wide.param.19 = ($SHARD, $SHARD, u32[]{:T(128)}) parameter(0)
  %get-tuple-element.4623 = $SHARD get-tuple-element(%wide.param.19), index=0
  %collective-permute-start.44 = ($SHARD, $SHARD, u32[]{:S(2)}, \
u32[]{:S(2)}) collective-permute-start(%get-tuple-element.4623), channel_id=3, \
source_target_pairs={{0,7},{1,0},{2,1},{3,2},{4,3},{5,4},{6,5},{7,6}}
  %get-tuple-element.4627 = u32[]{:T(128)} get-tuple-element(%wide.param.19), index=2
  %get-tuple-element.4626 = $SHARD get-tuple-element(%wide.param.19), index=1
  %collective-permute-start.46 = ($SHARD, $SHARD, u32[]{:S(2)}, \
u32[]{:S(2)}) collective-permute-start(%get-tuple-element.4626), channel_id=4, \
source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}
  %add.1006 = u32[]{:T(128)} add(%get-tuple-element.4627, %constant.2175..sunk.1..sunk)
  %collective-permute-done.44 = $SHARD collective-permute-done(%collective-permute-start.44)
  %collective-permute-start.45 = ($SHARD, $SHARD, u32[]{:S(2)}, \
u32[]{:S(2)}) collective-permute-start(%collective-permute-done.44), channel_id=5, \
source_target_pairs={{0,7},{1,0},{2,1},{3,2},{4,3},{5,4},{6,5},{7,6}}
  %collective-permute-done.46 = $SHARD collective-permute-done(%collective-permute-start.46)
  %collective-permute-start.47 = ($SHARD, $SHARD, u32[]{:S(2)}, \
u32[]{:S(2)}) collective-permute-start(%collective-permute-done.46), channel_id=6, \
source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}
  %collective-permute-done.45 = $SHARD collective-permute-done(%collective-permute-start.45)
  %collective-permute-done.47 = $SHARD collective-permute-done(%collective-permute-start.47)
  ROOT %tuple.521 = ($SHARD, $SHARD, u32[]{:T(128)}) tuple(%collective-permute-done.45, \
%collective-permute-done.47, %add.1006)
}

ENTRY %main.42_spmd (p: bf16[1,8,3,4,16]) -> bf16[1,8,3,4,16] {
  %p = $SHARD parameter(0)
  %copy.157 = $SHARD copy(%p)
  %collective-permute-start.60 = ($SHARD, $SHARD, u32[]{:S(2)}, \
u32[]{:S(2)}) collective-permute-start(%copy.157), channel_id=2, \
source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}, \
metadata={op_name="jit(traced)/jvp()/while/body/eval_jaxpr/btd,dchk->cbthk/dot_general"}
  %collective-permute-done.60 = $SHARD collective-permute-done(%collective-permute-start.60)
  %user-permute = $SHARD collective-permute(%p), channel_id=9, \
source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}, metadata={op_name="jit(traced)/ppermute"}
  %constant.1122..sunk.2 = u32[]{:T(128)} constant(0)
  %copy.275 = u32[]{:T(128)} copy(%constant.1122..sunk.2)
  %tuple.519 = ($SHARD, $SHARD, u32[]{:T(128)}) tuple(%copy.157, %collective-permute-done.60, %copy.275)
  %while.176 = ($SHARD, $SHARD, u32[]{:T(128)}) while(%tuple.519), \
condition=%wide.windowed_dot_general_cond_ag.clone, body=%wide.windowed_dot_general_body_ag.clone.sunk, \
metadata={op_name="jit(traced)/jvp()/while/body/eval_jaxpr/btd,dchk->cbthk/dot_general"}
  ROOT %out = $SHARD get-tuple-element(%while.176), index=0
}
""".replace("\\\n", "").replace("$SHARD", "bf16[1,8,3,4,16]{4,1,0,3,2:T(8,128)(2,1)}")


def test_windowed_einsum_permutes_are_the_all_gather_they_replace():
    found = {c.name: c for c in collectives(WINDOWED)}
    windowed = [c for c in found.values() if c.via == "windowed einsum"]
    assert {c.name for c in windowed} == {f"collective-permute-start.{i}" for i in (44, 45, 46, 47, 60)}
    assert all(c.kind == "all-gather" and c.bytes == 8 * 3 * 4 * 16 * 2 for c in windowed)
    # Two trips of four permutes, and the one before the loop: 9 shards sent, where a ring all-gather sends 7.
    assert sum(c.executions for c in windowed) == 9
    user = found["user-permute"]
    assert (user.kind, user.via, user.executions) == ("collective-permute", "", 1)


def test_a_windowed_reduce_scatter_and_its_last_permute_after_the_loop():
    text = WINDOWED.replace("_ag", "_rs")
    # Move the permute from before the loop to after it, where a reduce-scatter sends its last partial sum on.
    text = text.replace("collective-permute-start(%copy.157)", "collective-permute-start(%out)")
    text = text.replace("tuple(%copy.157, %collective-permute-done.60, %copy.275)", "tuple(%copy.157, %p, %copy.275)")
    found = {c.name: c for c in collectives(text)}
    assert found["collective-permute-start.60"].kind == "reduce-scatter"
    assert found["collective-permute-start.44"].kind == "reduce-scatter"
    assert found["user-permute"].kind == "collective-permute"


# Trimmed from the TPU train step of gpt-tiny over two v5p:2x2x2 slices (fsdp=2, tensor=4 in a slice, data=2 across):
# the program is one slice's, and hands what crosses slices to the megascale runtime as sends.
MEGASCALE = """HloModule jit_traced, is_scheduled=true, num_partitions=8

ENTRY %main.42_spmd (p: f32[8,8,128], q: f32[64,32]) -> token[] {
  %p = f32[8,8,128]{2,1,0:T(8,128)} parameter(0)
  %q = f32[64,32]{0,1:T(8,128)} parameter(1)
  %after-all = token[] after-all()
  %send.2 = (f32[8,8,128]{2,1,0:T(8,128)}, u32[]{:S(2)}, token[]) send(%p, %after-all), channel_id=5, \
is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",\
_xla_host_transfer_rendezvous="all-reduce.67_0",_xla_megascale_target="{1,2}x{0:7}",\
_xla_megascale_transfer_type="ALL_REDUCE",is_spmd_generated="true"}
  ROOT %send = (f32[64,32]{0,1:T(8,128)}, u32[]{:S(2)}, token[]) send(%q, %after-all), channel_id=4, \
is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",\
_xla_host_transfer_rendezvous="collective-permute_0",_xla_megascale_target={{200000->100006},{100001->200000}},\
_xla_megascale_transfer_type="ONE_TO_ONE",is_spmd_generated="true"}
}
""".replace("\\\n", "")
SLICE_IDS = [100000, 100001, 100003, 100002, 100006, 100007, 100005, 100004]  # slice 1's devices; slice 2: 2000xx


def test_sends_between_slices_are_collectives_over_the_slices():
    ids = SLICE_IDS + [i + 100000 for i in SLICE_IDS]
    found = {c.name: c for c in collectives(MEGASCALE, ids)}
    reduce, permute = found["send.2"], found["send"]
    assert (reduce.kind, reduce.via, reduce.bytes) == ("all-reduce", "DCN send", 8 * 8 * 128 * 4)
    assert reduce.groups == tuple((p, 8 + p) for p in range(8))  # each partition with its twin in the other slice
    assert (permute.kind, permute.pairs) == ("collective-permute", ((8, 4), (1, 8)))
    with pytest.raises(ValueError, match=r"send sends between device ids \[100001, 100006, 200000\]"):
        collectives(MEGASCALE)
