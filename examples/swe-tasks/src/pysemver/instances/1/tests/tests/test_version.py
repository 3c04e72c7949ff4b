import pytest

from semver import Version


def test_parse_full():
    v = Version.parse("1.2.3-beta.1+exp.sha.5114f85")
    assert (v.major, v.minor, v.patch) == (1, 2, 3)
    assert v.prerelease == ("beta", "1")
    assert v.build == ("exp", "sha", "5114f85")


def test_str_round_trip():
    for text in ["0.0.1", "1.0.0-alpha", "2.1.7+build.11", "3.0.0-rc.1+meta"]:
        assert str(Version.parse(text)) == text


@pytest.mark.parametrize("text", ["1.2", "01.2.3", "1.2.3-", "1.2.3+", "v1.2.3"])
def test_invalid_versions_are_rejected(text):
    with pytest.raises(ValueError):
        Version.parse(text)


def test_core_precedence():
    assert Version.parse("1.9.0") < Version.parse("1.10.0") < Version.parse("2.0.0")


def test_build_metadata_is_ignored():
    assert Version.parse("1.0.0+a") == Version.parse("1.0.0+b")


def test_bump():
    v = Version.parse("1.2.3-rc.1")
    assert str(v.bump("major")) == "2.0.0"
    assert str(v.bump("minor")) == "1.3.0"
    assert str(v.bump("patch")) == "1.2.4"


def test_prerelease_sorts_before_release():
    assert Version.parse("1.0.0-alpha") < Version.parse("1.0.0")
    assert Version.parse("1.0.0") > Version.parse("1.0.0-rc.1")


def test_numeric_identifiers_compare_as_numbers():
    assert Version.parse("1.0.0-rc.9") < Version.parse("1.0.0-rc.10")


def test_spec_precedence_example():
    texts = [
        "1.0.0-alpha",
        "1.0.0-alpha.1",
        "1.0.0-alpha.beta",
        "1.0.0-beta",
        "1.0.0-beta.2",
        "1.0.0-beta.11",
        "1.0.0-rc.1",
        "1.0.0",
    ]
    versions = [Version.parse(t) for t in texts]
    assert sorted(reversed(versions)) == versions
