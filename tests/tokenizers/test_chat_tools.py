"""Tools given as Python functions: lmkit's schema against transformers' get_json_schema, and the text and ids that
tool-using templates of the TRL wheel render from functions, against transformers' apply_chat_template."""
import enum
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import pytest

transformers = pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402
from transformers.utils import get_json_schema as hf_schema  # noqa: E402

import lmkit  # noqa: E402
from lmkit.errors import LmkitError  # noqa: E402
from lmkit.tokenizers.chat_tools import ToolSchemaError, get_json_schema  # noqa: E402
from test_chat_template import CHATS, TEMPLATES, _folder  # noqa: E402


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


class Mixed(enum.Enum):
    ONE = 1
    TEXT = "t"
    OFF = None


def get_weather(city: str, unit: Optional[str] = "celsius", days: int = 1) -> dict:
    """
    Get the weather forecast of a city.

    Args:
        city: The city, e.g. "Paris".
        unit: Unit of temperature (choices: ["celsius", "fahrenheit"])
        days: How many days
            to forecast, counting today.

    Returns:
        The forecast, one entry per day.
    """


def mixed_types(a: List[int], b: Dict[str, float], c: Union[int, str], d: int | None, e: Literal["x", 1, True],
                f: tuple[int, str], g: Any, h: list, i: dict, j: Union[List[int], str, None], k: Colour,
                m: Mixed, n: float | int | bool) -> Tuple[int, str]:
    """Mixes every hint the schema knows.
    Args:
        a (list of int): integers
        b (dict): a map
           to floats
        c: int or str
        d: maybe an int
        e: a literal
        f: a pair
        g: anything
        h: a bare list
        i: a bare dict
        j: ints or a string (choices: [1, 2, " three "])
        k: a colour
        m: a mixed enum
        n: a number
    Raises:
        ValueError: never
    """


def no_args_no_return():
    """Does nothing at all, and says so."""


class Thermostat:
    def set_target(self, degrees: float, room: str = "hall") -> None:
        """Set the target temperature.

        Args:
            degrees: Degrees Celsius.
              Note: this line goes deeper, so it continues the description.
            room: Which room.
        Returns:
            Nothing.
        """

    @classmethod
    def make(cls, name: str) -> "Thermostat":
        """Build one. Args: inline, not a section

        Args:
            name: its name
        """


class Point:
    pass


def custom_return(x: int) -> Point:
    """Returns a point.

    Args:
        x: the x
    """


FUNCTIONS = [get_weather, mixed_types, no_args_no_return, Thermostat().set_target, Thermostat.make, custom_return]


@pytest.mark.parametrize("func", FUNCTIONS, ids=[f.__name__ for f in FUNCTIONS])
def test_schema_matches_get_json_schema(func):
    ours, theirs = get_json_schema(func), hf_schema(func)
    assert ours == theirs
    assert list(ours["function"]["parameters"]["properties"].items()) == \
           list(theirs["function"]["parameters"]["properties"].items())  # order too: templates print it
    for (_, a), (_, b) in zip(ours["function"]["parameters"]["properties"].items(),
                              theirs["function"]["parameters"]["properties"].items()):
        assert list(a) == list(b)


def no_doc(x: int):
    pass


def undescribed(x: int, y: int):
    """Adds.

    Args:
        x: the first
    """


def unhinted(x, y: int):
    """Adds.

    Args:
        x: the first
        y: the second
    """


def custom_arg(p: Point):
    """Uses a point.

    Args:
        p: the point
    """


def single_tuple(p: tuple[int]):
    """A one-tuple.

    Args:
        p: the tuple
    """


def ellipsis_tuple(p: tuple[int, ...]):
    """A tuple of any length.

    Args:
        p: the tuple
    """


def bad_choices(p: str):
    """Bad choices.

    Args:
        p: the p (choices: [tea, coffee])
    """


def bad_literal(p: Literal[(1, 2)] | Literal[b"x"]):
    """Bytes literal.

    Args:
        p: the p
    """


class Empty(enum.Enum):
    pass


def empty_enum(p: Empty):
    """Empty enum.

    Args:
        p: the p
    """


BAD = [no_doc, undescribed, unhinted, custom_arg, single_tuple, ellipsis_tuple, bad_choices, bad_literal, empty_enum]


@pytest.mark.parametrize("func", BAD, ids=[f.__name__ for f in BAD])
def test_what_get_json_schema_refuses_is_one_line_error(func):
    with pytest.raises(Exception):
        hf_schema(func)
    with pytest.raises(ToolSchemaError) as e:
        get_json_schema(func)
    assert isinstance(e.value, LmkitError) and "\n" not in str(e.value)


TOOL_TEMPLATES = [p for p in TEMPLATES if p.stem in ("qwen2_5", "llama3_1", "qwen3_training", "gptoss", "gemma4",
                                                                  "nemotron_3_nano", "glm4moe", "lfm2")]


@pytest.mark.parametrize("path", TOOL_TEMPLATES, ids=[p.stem for p in TOOL_TEMPLATES])
def test_function_tools_render_as_transformers(path, tmp_path):
    template = path.read_text(encoding="utf-8")
    assert "tools" in template
    folder = _folder(tmp_path, "bpe", template)
    ours, theirs = lmkit.load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    tools = [get_weather, Thermostat().set_target, mixed_types]
    for chat in (CHATS["one_user"], CHATS["tools"]):
        text = ours.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
        assert "fahrenheit" in text and "set_target" in text
        assert ours.apply_chat_template(chat, tools=tools, return_dict=False) == \
               theirs.apply_chat_template(chat, tools=tools, return_dict=False)
    # a function and its schema render alike
    assert ours.apply_chat_template(CHATS["one_user"], tools=[get_weather], tokenize=False) == \
           ours.apply_chat_template(CHATS["one_user"], tools=[hf_schema(get_weather)], tokenize=False)
    with pytest.raises(ToolSchemaError, match="not int"):
        ours.apply_chat_template(CHATS["one_user"], tools=[3], tokenize=False)
