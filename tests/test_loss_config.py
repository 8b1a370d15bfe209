"""The loss config: every bad value refused with a message naming its key; YAML loading; the
config checked against the tokenizers (spec section 8, pitfall 4)."""

from __future__ import annotations

import math

import pytest

from crosskd.config import load_config
from crosskd.errors import ConfigError
from crosskd.loss import LossConfig, TeacherLossConfig, check_teachers

TABLES = {"student_to_teacher": "s2t.safetensors", "teacher_to_student": "t2s.safetensors"}


def test_defaults_are_valid_and_give_the_csd_options():
    config = LossConfig()
    assert config.teachers == [TeacherLossConfig()]
    assert config.teachers[0].same_tokenizer
    assert config.csd_options().mismatch_weight == 1.0  # the spec's 5 lost in both settings
    options = LossConfig(keep_realized=True, mismatch_weight=2.5).csd_options()
    assert options.keep_realized and options.mismatch_weight == 2.5


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"divergence": "kl"}, r"divergence is 'kl'; choose one of jsd, forward_kl, reverse_kl"),
        ({"beta": 0.0}, r"beta is 0\.0; the JSD mixture weight must be in \(0, 1\)"),
        ({"beta": 1}, r"beta is 1;"),
        ({"beta": math.nan}, r"beta is nan; it must be a finite number"),
        ({"tau": 0}, r"tau is 0; the temperature must be > 0"),
        ({"tau": "2"}, r"tau is '2'; it must be a finite number"),
        ({"ce_weight": -1.0}, r"ce_weight is -1\.0; it must be >= 0\.0"),
        ({"kd_weight": math.inf}, r"kd_weight is inf; it must be a finite number"),
        ({"mismatch_weight": -0.5}, r"mismatch_weight is -0\.5"),
        ({"max_kd_scale": 0}, r"max_kd_scale is 0; it must be > 0"),
        ({"dynamic_kd_scale": "yes"}, r"dynamic_kd_scale is 'yes'; write true or false"),
        ({"keep_realized": 1}, r"keep_realized is 1; write true or false"),
        ({"min_mismatch_support": 0}, r"min_mismatch_support is 0; it must be an integer >= 1"),
        ({"min_mismatch_support": True}, r"min_mismatch_support is True"),
        ({"teacher_mode": "mean"}, r"teacher_mode is 'mean'; choose one of sum, select, average"),
        ({"teachers": []}, r"teachers is empty"),
        ({"teachers": [{}, {"k": -1}]}, r"teachers\[1\]\.k is -1; it must be an integer >= 0"),
        ({"teachers": [{"k": 2.5}]}, r"teachers\[0\]\.k is 2\.5"),
        ({"teachers": [{"weight": -1}]}, r"teachers\[0\]\.weight is -1; it must be >= 0\.0"),
        (
            {"teachers": [{"kk": 1}]},
            r"teachers\[0\]: unknown key\(s\) kk; known keys: algorithm, k, projection, ",
        ),
        ({"teachers": ["qwen"]}, r"teachers\[0\] is 'qwen'; write a mapping with keys weight, k"),
        (
            {"teachers": [{"student_to_teacher": "a"}]},
            r"teachers\[0\]\.student_to_teacher is set but teachers\[0\]\.teacher_to_student is "
            r"not",
        ),
        (
            {"teachers": [{"teacher_to_student": "a"}]},
            r"teachers\[0\]\.teacher_to_student is set but teachers\[0\]\.student_to_teacher",
        ),
        ({"teacher_mode": "average"}, r"'average' with one teacher"),
        (
            {"teacher_mode": "average", "teachers": [{"k": 0}, {"k": 128}]},
            r"teacher_mode is 'average' but teachers\[1\]\.k is 128; .* dense signal \(k: 0\)",
        ),
        (
            {"teacher_mode": "average", "teachers": [{"k": 0}, {"k": 0, **TABLES}]},
            r"'average' but the teachers have different tables",
        ),
        (
            {"teacher_mode": "average", "teachers": [{"k": 0, "weight": 0}, {"k": 0, "weight": 0}]},
            r"every teachers\[\*\]\.weight is 0",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(values, match):
    with pytest.raises(ConfigError, match=match):
        LossConfig(**values)


def test_loaded_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "loss.yaml"
    path.write_text(
        "divergence: forward_kl\ntau: 2.0\nteacher_mode: select\nteachers:\n"
        "  - {k: 64, student_to_teacher: a.safetensors, teacher_to_student: b.safetensors}\n"
        "  - {weight: 0.5}\n"
    )
    config = load_config(LossConfig, str(path), ["dynamic_kd_scale=true", "max_kd_scale=50"])
    assert config.divergence == "forward_kl" and config.tau == 2.0
    assert config.dynamic_kd_scale and config.max_kd_scale == 50
    assert [t.k for t in config.teachers] == [64, 128]
    assert [t.same_tokenizer for t in config.teachers] == [False, True]
    assert config.teachers[1].weight == 0.5
    with pytest.raises(ConfigError, match=r"teachers\[1\]\.k is -3"):
        load_config(LossConfig, str(path), ["teachers=[{k: 1}, {k: -3}]"])


def test_a_teacher_without_tables_must_have_the_students_tokenizer(zoo):
    """Pitfall 4: the error says "same tokenizer" and which fingerprint fields differ."""
    llama, qwen = zoo("llama3"), zoo("qwen3")
    check_teachers(LossConfig(), llama, [zoo("llama3")])
    with pytest.raises(ConfigError) as err:
        check_teachers(LossConfig(), llama, [qwen])
    message = str(err.value)
    assert "teachers[0] has no tables" in message and "same-tokenizer teacher" in message
    fields = message.split("differs from the student's")[1]
    for field in ("model", "normalizer", "pre_tokenizer", "added_tokens"):
        assert f" {field}," in fields or f" {field}." in fields
    assert "split_special_tokens" not in fields  # equal in both: not listed
    check_teachers(LossConfig(teachers=[TeacherLossConfig(**TABLES)]), llama, [qwen])
    with pytest.raises(ConfigError, match=r"teachers lists 1 teacher\(s\) but 2 teacher"):
        check_teachers(LossConfig(), llama, [qwen, qwen])


def test_average_needs_one_tokenizer_and_one_vocabulary(zoo):
    config = LossConfig(teacher_mode="average", teachers=[TeacherLossConfig(k=0, **TABLES)] * 2)
    check_teachers(config, zoo("llama3"), [zoo("qwen3"), zoo("qwen3")])
    with pytest.raises(ConfigError, match=r"teachers\[1\] \(.*\) does not share teachers\[0\]"):
        check_teachers(config, zoo("llama3"), [zoo("qwen3"), zoo("qwen2")])
