"""Reading packages: genai_config.json checked against its graph, typed fields, confined file names,
tokenizer files and chat templates (as transformers reads them), -m paths, --kv static up front.

The corrupt packages are copies of tiny random-weights packages (weights hard-linked: a symlinked data
file is itself refused), each with one field or file changed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from onnxgen.cli import main
from onnxgen.errors import InvalidInputError, ModelLoadError
from onnxgen.genai import Generator
from onnxgen.genai.chat import ChatTemplateError, render_chat
from onnxgen.genai.package import load_package_config
from onnxgen.genai.tokenizer import Tokenizer
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from tests.test_capture_runtime import write_word_tokenizer

TINY = TINY_CONFIGS["tiny-llama"]  # 3 layers, 2 KV heads of 16, vocab 512, context 256 (the graph's tables)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    packages = {}
    for attention in ("gqa", "standard"):
        directory = build_package(RandomSource(TINY), root / attention, attention=attention)
        write_word_tokenizer(directory, TINY.vocab_size)
        packages[attention] = directory
    return packages


def clone(src: Path, dst: Path) -> Path:
    """A copy of package ``src`` in ``dst``; the weights file hard-linked (or copied)."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name == "model.onnx.data":
            try:
                os.link(item, dst / item.name)
                continue
            except OSError:
                pass
        shutil.copy2(item, dst / item.name)
    return dst


def edit_config(package: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    path = package / "genai_config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))
    return package


def model(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg["model"]


def decoder(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg["model"]["decoder"]


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


# -- item 4: genai_config.json against the graph ----------------------------------------------------

MISMATCHES = {
    "vocab": (lambda c: model(c).update(vocab_size=1000), "model.vocab_size is 1000, but the decoder's logits"),
    "fewer layers": (
        lambda c: decoder(c).update(num_hidden_layers=2),
        "model.decoder.num_hidden_layers is 2, but the decoder has 3 layers",
    ),
    "more layers": (
        lambda c: decoder(c).update(num_hidden_layers=4),
        "model.decoder.num_hidden_layers is 4, but the decoder has 3 layers",
    ),
    "head size": (lambda c: decoder(c).update(head_size=8), "model.decoder.head_size is 8, but"),
    "kv heads": (lambda c: decoder(c).update(num_key_value_heads=4), "model.decoder.num_key_value_heads is 4, but"),
    "context": (lambda c: model(c).update(context_length=512), "model.context_length is 512, but"),
    "input name": (
        lambda c: decoder(c)["inputs"].update(attention_mask="mask"),
        "model.decoder.inputs.attention_mask names 'mask'",
    ),
    "input_ids name": (
        lambda c: decoder(c)["inputs"].update(input_ids="tokens"),
        "model.decoder.inputs.input_ids names 'tokens'",
    ),
    "logits name": (
        lambda c: decoder(c)["outputs"].update(logits="scores"),
        "model.decoder.outputs.logits names 'scores'",
    ),
    "past names": (
        lambda c: decoder(c)["inputs"].update(past_key_names="past.%d.k"),
        "model.decoder.inputs.past_key_names names 'past.0.k'",
    ),
    "present names": (
        lambda c: decoder(c)["outputs"].update(present_value_names="present_value.%d"),
        "model.decoder.outputs.present_value_names names 'present_value.0'",
    ),
}


@pytest.mark.parametrize("attention", ["gqa", "standard"])
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_config_checked_against_graph(tiny, tmp_path, attention, case):
    change, message = MISMATCHES[case]
    package = edit_config(clone(tiny[attention], tmp_path / "p"), change)
    with pytest.raises(ModelLoadError, match="genai_config.json") as info:
        Generator(package)
    assert message in str(info.value)


def test_unmapped_graph_input_named(tiny, tmp_path):
    """A graph input the config does not map (position_ids under another name) is named at load."""
    package = edit_config(clone(tiny["standard"], tmp_path / "p"), lambda c: decoder(c)["inputs"].pop("position_ids"))
    generator = Generator(package)  # onnxruntime-genai's default name applies: position_ids is fed
    assert generator.has_positions
    package = edit_config(package, lambda c: decoder(c)["inputs"].update(position_ids="pos"))
    with pytest.raises(ModelLoadError, match="model.decoder.inputs.position_ids names 'pos'"):
        Generator(package)
    # a graph input under a name no config key maps: named at load, not a missing feed at run time
    import onnx

    edit_config(package, lambda c: decoder(c)["inputs"].pop("position_ids"))
    proto = onnx.load(package / "model.onnx", load_external_data=False)
    for value in proto.graph.input:
        if value.name == "position_ids":
            value.name = "cache_position"
    for node in proto.graph.node:
        node.input[:] = ["cache_position" if name == "position_ids" else name for name in node.input]
    onnx.save(proto, package / "model.onnx")
    with pytest.raises(ModelLoadError, match="input.s. cache_position that model.decoder.inputs does not map"):
        Generator(package)


def test_symbolic_dims_are_not_judged(tiny, tmp_path):
    """A graph whose KV and logits dims are symbolic states nothing: any positive value loads."""
    import onnx

    package = clone(tiny["gqa"], tmp_path / "p")
    proto = onnx.load(package / "model.onnx", load_external_data=False)
    for value in list(proto.graph.input) + list(proto.graph.output):
        for index, dim in enumerate(value.type.tensor_type.shape.dim):
            if index > 0 and dim.HasField("dim_value"):
                dim.dim_param = f"{value.name}_{index}"
    onnx.save(proto, package / "model.onnx")
    edit_config(
        package, lambda c: decoder(c).update(head_size=8, num_key_value_heads=4) or model(c).update(vocab_size=600)
    )
    config = Generator(package).config
    assert (config.head_size, config.num_kv_heads, config.vocab_size) == (8, 4, 600)


def test_real_package_passes_and_weights_are_read_once(monkeypatch):
    """The real int4 package loads unchanged, and validation reads no weights: every external tensor
    is read exactly once."""
    import onnx

    from onnxgen.models.pull import cached_package
    from onnxgen.runtime import model_io

    package = cached_package("smollm2-135m-instruct")
    if package is None:
        pytest.skip("the int4 cpu package of the default model is not cached")
    proto = onnx.load(package / "model.onnx", load_external_data=False)
    external = [t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    reads: list[str] = []
    original = model_io.read_external_bytes
    monkeypatch.setattr(
        model_io, "read_external_bytes", lambda t, d, **kw: reads.append(t.name) or original(t, d, **kw)
    )
    Generator(package)
    assert sorted(reads) == sorted(external)


# -- item 9: wrong types in genai_config.json, unreadable tokenizer files ---------------------------

BAD_FIELDS = {
    "context string": (lambda c: model(c).update(context_length="abc"), "model.context_length is 'abc'"),
    "decoder null": (lambda c: model(c).update(decoder=None), "model.decoder is null; expected an object"),
    "negative vocab": (lambda c: model(c).update(vocab_size=-5), "model.vocab_size is -5; expected a positive"),
    "decoder list": (lambda c: model(c).update(decoder=[1]), "model.decoder is a list; expected an object"),
    "inputs list": (lambda c: decoder(c).update(inputs=["input_ids"]), "model.decoder.inputs is a list"),
    "eos string": (lambda c: model(c).update(eos_token_id="2"), "model.eos_token_id is '2'"),
    "eos list item": (lambda c: model(c).update(eos_token_id=[2, "x"]), "model.eos_token_id[1] is 'x'"),
    "eos out of vocab": (lambda c: model(c).update(eos_token_id=99999), "model.eos_token_id is 99999, outside"),
    "bool for int": (lambda c: decoder(c).update(head_size=True), "model.decoder.head_size is true"),
    "float for int": (lambda c: decoder(c).update(num_hidden_layers=2.5), "model.decoder.num_hidden_layers is 2.5"),
    "filename number": (lambda c: decoder(c).update(filename=5), "model.decoder.filename is 5; expected"),
    "name without %d": (
        lambda c: decoder(c)["inputs"].update(past_key_names="past"),
        "model.decoder.inputs.past_key_names is 'past'; expected a name with one %d",
    ),
    "share buffer string": (
        lambda c: c["search"].update(past_present_share_buffer="yes"),
        "search.past_present_share_buffer is 'yes'; expected true or false",
    ),
    "model list": (lambda c: c.update(model=[]), "genai_config.json: model is a list; expected an object"),
}


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_bad_config_types_are_one_line_errors(tiny, tmp_path, case):
    change, message = BAD_FIELDS[case]
    package = edit_config(clone(tiny["gqa"], tmp_path / "p"), change)
    with pytest.raises(ModelLoadError) as info:
        Generator(package)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("genai_config.json", b"\xff\xfe{not utf-8", "genai_config.json is not UTF-8 text"),
        ("genai_config.json", b"[1, 2]", "genai_config.json: the top level is a list; expected an object"),
        ("tokenizer_config.json", b'{"eos_token": "w2",', "tokenizer_config.json is not valid JSON"),
        ("tokenizer_config.json", b"\xff\xfe\x00", "tokenizer_config.json is not UTF-8 text"),
        ("tokenizer_config.json", b'["w2"]', "tokenizer_config.json: the top level is a list; expected an object"),
        ("tokenizer_config.json", b'{"eos_token": 2}', "tokenizer_config.json: eos_token is 2; expected a string"),
        ("tokenizer_config.json", b'{"chat_template": 7}', "tokenizer_config.json: chat_template is 7"),
        ("tokenizer.json", b"{", "tokenizer.json could not be read"),
        ("chat_template.jinja", b"\xff\xfe", "chat_template.jinja is not UTF-8 text"),
    ],
)
def test_unreadable_package_files_are_one_line_errors(tiny, tmp_path, capsys, name, content, message):
    package = clone(tiny["gqa"], tmp_path / "p")
    (package / name).write_bytes(content)
    code, out, err = cli(capsys, "generate", "-m", str(package), "-p", "w3 w4", "-n", "2", "--chat")
    assert code == 2 and out == ""
    assert err.startswith("onnxgen: error: ") and err.count("\n") == 1, err
    assert message in err


# -- item 10: every file a package names stays inside it -------------------------------------------


@pytest.mark.parametrize(
    "filename, message",
    [
        ("/etc/passwd", "model.decoder.filename '/etc/passwd' is absolute"),
        ("../outside/model.onnx", "model.decoder.filename '../outside/model.onnx' climbs out with '..'"),
    ],
)
def test_decoder_filename_confined(tiny, tmp_path, filename, message):
    package = clone(tiny["gqa"], tmp_path / "p")
    clone(tiny["gqa"], tmp_path / "outside")
    edit_config(package, lambda c: decoder(c).update(filename=filename))
    with pytest.raises(ModelLoadError) as info:
        load_package_config(package)
    assert message in str(info.value)


@pytest.mark.parametrize("name", ["model.onnx", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_symlink_out_of_package_refused(tiny, tmp_path, name):
    package = clone(tiny["gqa"], tmp_path / "p")
    outside = clone(tiny["gqa"], tmp_path / "outside")
    (outside / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (package / name).unlink(missing_ok=True)
    (package / name).symlink_to(outside / name)
    with pytest.raises(ModelLoadError, match=f"{name}.* outside the package directory"):
        Generator(package).apply_chat_template([{"role": "user", "content": "w3"}])


def test_symlink_inside_package_is_fine(tiny, tmp_path):
    package = clone(tiny["gqa"], tmp_path / "p")
    (package / "real").mkdir()
    (package / "model.onnx").rename(package / "real" / "model.onnx")
    (package / "model.onnx").symlink_to(package / "real" / "model.onnx")
    (package / "real" / "model.onnx.data").symlink_to(package / "model.onnx.data")
    assert Generator(package).generate("w3 w4", _params(2)) is not None


def _params(n: int):
    from onnxgen.genai import SamplingParams

    return SamplingParams(max_new_tokens=n)


# -- item 12: chat_template.jinja, as transformers reads it ----------------------------------------


@pytest.fixture(scope="module")
def real_tokenizer(tmp_path_factory) -> Path:
    """The default model's tokenizer files (no weights: Tokenizer and transformers need none)."""
    from onnxgen.models.pull import cached_package

    package = cached_package("smollm2-135m-instruct")
    if package is None:
        pytest.skip("the int4 cpu package of the default model is not cached")
    out = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(package / name, out / name)
    return out


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
OTHER = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
)


def _variant(real: Path, tmp: Path, jinja: str | None, config_template: Any) -> Path:
    out = tmp / "tok"
    out.mkdir(parents=True)
    shutil.copyfile(real / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((real / "tokenizer_config.json").read_text())
    original = config.pop("chat_template")
    if config_template == "original":
        config["chat_template"] = original
    elif config_template is not None:
        config["chat_template"] = config_template(original)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (out / "chat_template.jinja").write_text(original if jinja == "original" else jinja)
    return out


@pytest.mark.parametrize(
    "jinja, config_template",
    [
        ("original", None),  # onnxruntime-genai's builder: the template only in chat_template.jinja
        (OTHER, "original"),  # both: the .jinja file wins
        (None, lambda t: [{"name": "tool_use", "template": OTHER}, {"name": "default", "template": t}]),
        (None, lambda t: {"default": t, "rag": OTHER}),
    ],
    ids=["jinja-only", "jinja-wins", "named-list", "named-dict"],
)
def test_chat_template_as_transformers_reads_it(real_tokenizer, tmp_path, jinja, config_template):
    from transformers import AutoTokenizer

    directory = _variant(real_tokenizer, tmp_path, jinja, config_template)
    expected = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    ours = Tokenizer(directory)
    assert render_chat(ours.chat_template, MESSAGES, bos_token=ours.bos_token, eos_token=ours.eos_token) == expected


def test_named_templates_without_default(real_tokenizer, tmp_path):
    directory = _variant(real_tokenizer, tmp_path, None, lambda t: [{"name": "a", "template": t}, {"name": "b"}])
    with pytest.raises(ModelLoadError, match=r"chat_template\[1\] has no 'template'"):
        Tokenizer(directory)
    from transformers import AutoTokenizer

    directory = _variant(real_tokenizer, tmp_path / "2", None, lambda t: {"a": t, "b": OTHER})
    with pytest.raises(ValueError, match="no default"):  # transformers refuses it too
        AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(MESSAGES, tokenize=False)
    with pytest.raises(ChatTemplateError, match=r"no 'default' among its named templates \['a', 'b'\]"):
        render_chat(Tokenizer(directory).chat_template, MESSAGES)


def test_chat_with_jinja_only_package(tiny, tmp_path, capsys):
    package = clone(tiny["gqa"], tmp_path / "p")
    (package / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}w5")
    code, out, err = cli(capsys, "generate", "-m", str(package), "-p", "w3 w4", "-n", "2", "--chat")
    assert code == 0, err
    assert "prompt 3 tok" in err  # w3 w4 w5


# -- item 13: -m paths ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["./no-such-package", "~/no-such-package-xyz", "missing/model.onnx", "x.onnx"])
def test_missing_path_is_named(capsys, value):
    code, _, err = cli(capsys, "generate", "-m", value, "-p", "hi")
    assert code == 2
    assert f"onnxgen: error: no such file or directory: {value} (expected a package directory or a registry name" in err
    assert "smollm2-135m-instruct" in err


@pytest.mark.parametrize("value", ["./nope", "~/no-such-package-xyz", "missing/model.onnx"])
def test_show_of_a_missing_path_is_named(capsys, value):
    code, _, err = cli(capsys, "show", value)
    assert code == 2
    assert f"onnxgen: error: no such file or directory: {value} (expected an .onnx file, a package directory" in err


def test_onnx_file_in_package_runs_its_package(tiny, capsys):
    code, out, err = cli(capsys, "generate", "-m", str(tiny["gqa"] / "model.onnx"), "-p", "w3 w4", "-n", "2")
    assert code == 0, err
    assert "new 2 tok" in err


@pytest.mark.parametrize("where", ["bare", "other file"])
def test_onnx_file_without_its_package_refused(tiny, tmp_path, capsys, where):
    if where == "bare":
        target = tmp_path / "bare.onnx"
        shutil.copyfile(tiny["gqa"] / "model.onnx", target)
    else:
        package = clone(tiny["gqa"], tmp_path / "p")
        target = package / "copy.onnx"
        shutil.copyfile(package / "model.onnx", target)
    code, _, err = cli(capsys, "generate", "-m", str(target), "-p", "hi")
    assert code == 2
    assert f"onnxgen: error: {target} is an ONNX file, not a package" in err
    assert "package directory" in err and "tokenizer" in err


def test_existing_non_package_file_refused(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("hi")
    code, _, err = cli(capsys, "generate", "-m", str(path), "-p", "hi")
    assert code == 2 and f"onnxgen: error: {path} is a file, not a package directory" in err


# -- item 14: --kv static only where the graph writes KV in place ---------------------------------


def test_static_kv_refused_for_growing_kv(tiny, capsys):
    with pytest.raises(InvalidInputError, match=r"present.0.key is made by Concat"):
        Generator(tiny["standard"], kv="static")
    code, _, err = cli(capsys, "generate", "-m", str(tiny["standard"]), "-p", "w3", "-n", "2", "--kv", "static")
    assert code == 2 and "kv static needs" in err and err.count("\n") == 1
    assert Generator(tiny["gqa"], kv="static").kv_kind == "static"


def test_share_buffer_config_on_growing_kv_refused(tiny, tmp_path):
    package = edit_config(
        clone(tiny["standard"], tmp_path / "p"), lambda c: c["search"].update(past_present_share_buffer=True)
    )
    with pytest.raises(ModelLoadError, match="search.past_present_share_buffer is true, but"):
        Generator(package)
