"""vramlab.configs_fields: a config's text parsed (JSON, TOML, YAML through the caller's parser) and its
bad input refused in one line. The fixtures are tests/test_configs.py's.
"""

import pytest

from vramlab import configs
from tests.test_configs import model, read  # noqa: F401 (fixtures)
from tests.test_configs_deepspeed import ACCELERATE_ZERO2
from tests.test_configs_hf import ACCELERATE_MULTI_GPU


# ----------------------------------------------------------------------------- input errors, one line each

@pytest.mark.parametrize("source, fmt, match", [
    ("{not json", None, "not valid JSON"),
    ("[training]\nseq_len = = 1", None, "not valid TOML"),
    ("just: some\nyaml: here\n", None, "not a format vramlab reads"),
    ("/no/such/file.json", None, "no such file"),
    (ACCELERATE_ZERO2, "nonsense", "format"),
])
def test_bad_input_is_one_line(source, fmt, match, model):
    with pytest.raises(ValueError) as e:
        read(source, fmt=fmt, model=model, seq_len=128)
    assert match in str(e.value) and "\n" not in str(e.value)


def test_yaml_without_pyyaml_is_one_line(monkeypatch, model):
    import sys

    # the pure layer imports no YAML parser: the caller gives one
    with pytest.raises(ValueError, match="yaml_loader"):
        configs.read_setup(ACCELERATE_MULTI_GPU, model=model, seq_len=128, batch_size=1)
    import yaml

    s = configs.read_setup(ACCELERATE_MULTI_GPU, model=model, seq_len=128, batch_size=1, yaml_loader=yaml.safe_load)
    assert s.fmt == "accelerate"
    with pytest.raises(ValueError, match="not valid YAML"):
        read("a: [unclosed\nb: 1\n", model=model)
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    with pytest.raises(ValueError, match="PyYAML"):
        read(ACCELERATE_MULTI_GPU, model=model, seq_len=128, batch_size=1)
    s = configs.read_setup(ACCELERATE_ZERO2, model=model, seq_len=128)  # JSON and TOML need nothing
    assert s.fmt == "deepspeed"
