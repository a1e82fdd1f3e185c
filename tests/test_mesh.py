"""Mesh layouts: parsing, filling -1, shipped files, device placement, and the errors users hit."""

import jax
import pytest

from jaxtrain.sharding.mesh import MeshError, MeshLayout, available_layouts, build_mesh, describe_mesh, parse_layout


def test_inline_layout_with_wildcard():
    mesh = build_mesh(parse_layout("data=2,fsdp=-1"))
    assert (mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"]) == (2, 4, 1)
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_describe_shows_axes_and_device_positions():
    text = describe_mesh(build_mesh(parse_layout("data=2,tensor=4")))
    assert text.splitlines()[0] == "Mesh data=2 tensor=4: 8 cpu devices"
    assert "data=1 tensor->[  4   5   6   7 ]" in text


def test_sizes_that_do_not_multiply_to_device_count():
    with pytest.raises(MeshError, match=r"multiplies to 6 devices, but 8 devices are available"):
        build_mesh(parse_layout("data=2,tensor=3"))


def test_two_wildcards():
    with pytest.raises(MeshError, match=r"are all -1, but only one axis may take the remaining devices"):
        parse_layout("data=-1,fsdp=-1")


def test_unknown_axis_name_lists_known_axes():
    known = "replica, data, pipeline, fsdp, expert, context, tensor"
    with pytest.raises(MeshError, match=rf"unknown axis name 'model'.*Known axes: {known}"):
        parse_layout("model=8")


def test_wildcard_that_cannot_be_filled():
    with pytest.raises(MeshError, match=r"fixed axis sizes multiply to 3, which does not divide the 8 devices"):
        build_mesh(parse_layout("tensor=3,data=-1"))


def test_unknown_layout_name():
    with pytest.raises(MeshError, match="unknown mesh 'cpu9'"):
        parse_layout("cpu9")


@pytest.mark.parametrize("name", available_layouts())
def test_every_shipped_layout_loads_and_describes_itself(name):
    layout = parse_layout(name)
    assert layout.description, f"meshes/{name}.toml needs a description saying when to use it"


@pytest.mark.parametrize("name,devices", [("tpu-v5p-128", 64), ("tpu-v5e-2x256", 512), ("gpu-1x8", 8), ("gpu-4x8", 32)])
def test_target_layouts_resolve_on_their_device_count(name, devices):
    ici, dcn = parse_layout(name).resolve(devices)
    total = 1
    for axis in ici:
        total *= ici[axis] * dcn[axis]
    assert total == devices


def test_hybrid_layout_builds_on_simulated_devices():
    layout = MeshLayout(axes={"fsdp": -1}, dcn_axes={"data": 2}, name="two-slices")
    mesh = build_mesh(layout)
    assert (mesh.shape["data"], mesh.shape["fsdp"]) == (2, 4)


def test_layout_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('description = "mine"\n[axes]\ndata = 4\ntensor = 2\n[rules]\nembed = ""\n')
    layout = parse_layout(str(path))
    assert layout.rules == {"embed": ""} and build_mesh(layout).shape["tensor"] == 2
    path.write_text("[axes]\ndata = 8\n[extra]\n")
    with pytest.raises(MeshError, match="unknown keys"):
        parse_layout(str(path))


def test_mesh_on_fewer_devices():
    assert build_mesh(parse_layout("tensor=4"), jax.devices()[:4]).size == 4
