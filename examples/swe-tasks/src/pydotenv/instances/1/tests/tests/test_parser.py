import pytest

from dotenv import DotenvError, load, parse


def test_basic_pairs():
    assert parse("A=1\nB=two\n") == {"A": "1", "B": "two"}


def test_comments_and_blank_lines_are_skipped():
    assert parse("# settings\n\nA=1\n   \n# end\n") == {"A": "1"}


def test_export_prefix():
    assert parse("export PATH_EXTRA=/opt/bin") == {"PATH_EXTRA": "/opt/bin"}


def test_quotes_are_removed():
    assert parse("A='one two'\nB=\"three\"\n") == {"A": "one two", "B": "three"}


def test_whitespace_around_key_and_value():
    assert parse("  A =  1  ") == {"A": "1"}


def test_missing_equals_reports_line():
    with pytest.raises(DotenvError) as info:
        parse("A=1\nB\n")
    assert info.value.line == 2


def test_load_reads_file(tmp_path):
    path = tmp_path / ".env"
    path.write_text("A=1\n", encoding="utf-8")
    assert load(path) == {"A": "1"}


def test_value_containing_equals():
    url = "postgres://app:secret@db/app?sslmode=require"
    assert parse(f"DATABASE_URL={url}") == {"DATABASE_URL": url}


def test_quoted_value_containing_equals():
    assert parse("OPTS=\"a=1 b=2\"") == {"OPTS": "a=1 b=2"}
