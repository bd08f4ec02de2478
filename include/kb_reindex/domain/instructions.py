"""What reads as an instruction to a model, in Chinese and English: the ways people phrase a prompt injection
inside a knowledge page (ignore, disregard or forget the rules; "from now on you are"; role and system-prompt
talk; requests to reveal the prompt, to approve everything, to call a tool or hand out personal data).

Knowledge text is data: a flagged line is never acted on, it is shown to a person (and, with
KB_INSTRUCTION_POLICY=block, refused). The patterns are written against policy text that merely uses the same
words ("请忽略外包装上的旧地址标签", "Please disregard the previous shipping estimate"): what follows the verb
must be the rules or instructions themselves, and "you are now" must be followed by a role, not a status.
They are the screen's fast first pass, read over normalised text (`kb_reindex.domain.screen_text`); a classifier
judges what they miss by its meaning (`kb_reindex.services.screen`). Measured on a labelled set of both kinds:
bench/instructions.py, bench/instructions.yaml.
"""

from __future__ import annotations

import re

from kb_reindex.domain.screen_text import passages

_RULES_EN = (r"(?:instructions?|rules?|guidelines?|guidance|directions?|directives?|policies|prompts?|constraints?"
             r"|restrictions?)")
_RULES_ZH = r"(?:规则|规定|指令|指示|要求|设定|限制|提示词?|约束|政策|条款|说明)"

#: (why, patterns): each group says why a line it matches is flagged
PATTERN_GROUPS: list[tuple[str, tuple[re.Pattern[str], ...]]] = [
    (why, tuple(re.compile(p, re.IGNORECASE) for p in patterns)) for why, patterns in (
    ('sets the rules aside', (
            # ignore / disregard / forget / override the rules (English)
            rf"\b(?:ignore|disregard|forget|override|bypass|skip|discard)\s+(?:all\s+|any\s+|the\s+|your\s+|these\s+|those\s+"
            rf"|every\s+|of\s+)*(?:previous\s+|prior\s+|above\s+|earlier\s+|preceding\s+|existing\s+|original\s+|other\s+"
            rf"|system\s+|safety\s+|store\s+|shop\s+)*{_RULES_EN}\b",
            r"\b(?:ignore|disregard|forget)\s+(?:everything|all)\s+(?:above|before|previously|you\s+were\s+told)",
            # 忽略 / 无视 / 忘记 ... 规则 (Chinese): the object must be the rules themselves
            rf"(?:忽略|无视|忘记|忘掉|忘了|不要理会|不用理会|别管|不必遵守|不要遵守|别遵守|跳过)(?:掉)?(?:你)?"
            rf"(?:之前|以上|上面|前面|上述|先前|此前|原来|原有|所有|全部|一切|其他|其它|这些|那些|平台|商城|系统)*的?"
            rf"(?:所有|全部|一切)?的?{_RULES_ZH}",
            r"(?:忽略|无视|忘记|忘掉)(?:以上|上面|前面|之前)(?:所有|全部)?(?:内容|的内容|说的|所说)",
    )),
    ('gives the assistant a new role', (
            # a new identity for the assistant
            r"\bfrom\s+now\s+on,?\s+(?:you\s+are|you're)\s+(?!required|eligible|entitled|responsible|able|allowed|not\b"
            r"|welcome|free)",
            r"\bfrom\s+now\s+on,?\s+(?:you\s+)?(?:will\s+|must\s+|should\s+)?(?:act|behave|respond|answer|reply|pretend)\s+as\b",
            r"\byou\s+are\s+now\s+(?:a\s+|an\s+|the\s+|my\s+)?(?:[\w-]+\s+){0,2}\S*(?:bot|gpt|assistant|ai|agent|model|dan)\b",
            r"\b(?:act|behave|pretend|roleplay|role-play)\s+(?:as|to\s+be)\s+(?:a\s+|an\s+|the\s+)?(?:[\w-]+\s+){0,2}\S*(?:bot"
            r"|gpt|assistant|ai|agent|model|administrator|admin|developer)\b",
            r"从现在(?:开始|起)[，,]?\s*你(?:就)?(?:是|要扮演|扮演|将扮演|的身份是|必须|只能|要|将)",
            r"你现在(?:是|扮演|的身份是)(?:一个|一名)?.{0,10}(?:机器人|助手|AI|ai|模型|客服|管理员)",
            r"(?:扮演|假装|充当)(?:一个|一名)?.{0,10}(?:机器人|助手|AI|ai|模型|管理员|开发者)",
    )),
    ('system-prompt talk or chat markup', (
            # system prompts, roles and chat markup
            r"\b(?:system|developer)\s+(?:prompt|message|instructions?)\b",
            r"系统提示词|系统指令|系统设定|开发者(?:模式|指令)",
            r"^\s*[\[<(]?\s*(?:system|assistant|系统|助手)\s*[\]>)]?\s*[:：]",
            # chat-template control tokens, of any model family: `<|...|>` (ChatML, Llama 3, Phi, GPT's own),
            # `[INST]`, `<<SYS>>`, Gemma's turns; a vocabulary no shop page writes. A heading that is the bare role
            # ("### Instruction:", "## System") is a template's; "## System Notice" or "## System requirements" is a
            # page's. (The screen reads a page's heading without its marks, so this meets a code block's line, or a
            # line read alone as bench/instructions.py's labelled lines once were.)
            r"<\|[a-z_]{2,30}\|>|\[/?INST\]|<</?SYS>>|<(?:start|end)_of_turn>|^\s*#{2,}\s*(?:instruction|system)\s*(?:[:：]|$)",
            r"\bnew\s+instructions?\s*[:：]|新(?:的)?指令\s*[:：]",
    )),
    ('asks for the prompt or configuration', (
            # requests to reveal the prompt or configuration
            r"\b(?:reveal|show|print|output|repeat|disclose|leak|tell\s+me)\s+(?:me\s+)?(?:your|the)\s+(?:system\s+prompt|"
            r"prompt|instructions|hidden|secret|configuration|initial)",
            r"(?:泄露|透露|告诉我|输出|显示|打印|复述|重复)(?:一下)?(?:你的)?(?:系统提示|提示词|指令|内部规则|初始设定|配置)",
    )),
    ('approves everything, or one answer whatever is asked', (
            # requests to approve everything, or to answer one way whatever is asked
            r"\b(?:approve|accept|grant|authorize|authorise)\s+(?:every|all|any)\s+(?:refund|return|request|claim|application)s?\b",
            r"\balways\s+(?:approve|agree|say\s+yes|grant|accept)\b",
            r"(?:无条件|一律|全部|直接)(?:批准|同意|通过)(?:所有|全部|任何|用户的|顾客的|客户的)*(?:退款|退货|申请|请求|赔付|理赔)",
            r"(?:对|给)(?:所有|任何)?(?:用户|顾客|客户)(?:都|一律)?(?:说|回答|回复)(?:是|可以|同意)",
            r"(?:所有|全部|任何)的?(?:退款|退货|赔付|理赔)?(?:申请|请求).{0,4}(?:一律|全部|都|直接|无条件)(?:批准|同意|通过)",
    )),
    ("asks for a tool call or someone's personal data", (
            # tools and personal data
            # ("use" or "run" only with a name in code, "run the export_users function": "2. Run the diagnostic tool
            # in the app." is a step for the customer, a written held-out page's line the patterns flagged)
            r"\b(?:call|invoke|execute)\s+the\s+\w+\s+(?:tool|function)\b",
            r"\b(?:use|run)\s+the\s+\w*_\w*\s+(?:tool|function)\b",
            # a call asked for, not one described ("开发者可调用订单接口", "调用开放接口前，请先认证"): the line starts with it, or asks for it
            r"(?:^|请|立即|马上|直接|现在|先|并)\s*调用.{0,8}(?:工具|tool|函数|接口)(?![前时后])",
            # someone else's data asked for: "the customer's phone number", not a warning to keep one's own
            r"(?:输出|提供|告诉我|发送|给出|列出|发给我)(?:所有|全部)?(?:客户|顾客|用户|买家|会员|他人|别人)的?.{0,4}"
            r"(?:手机号|电话号码|身份证|密码|银行卡|住址|家庭地址)",
            r"(?:手机号|电话号码|身份证号?|密码|银行卡号?)(?:都|全部)?(?:发给我|告诉我|发送给我)",
            r"\b(?:send|give|output|reveal|list|share|tell)\s+(?:me|us)?\s*(?:the\s+|all\s+)?(?:customers?|users?|buyers?)"
            r"(?:'s|s')?\s+(?:phone|password|credit\s+card|home\s+address|address)",
            r"\b(?:list|output|reveal|print|dump)\s+(?:all|every)\s+(?:the\s+)?(?:passwords?|phone\s+numbers?"
            r"|credit\s+card\s+numbers?)",
    )),
    )
]
INSTRUCTION_PATTERNS = [p for _, patterns in PATTERN_GROUPS for p in patterns]


#: a modal negation earlier in the same clause: "it cannot issue refunds or override any rule" says what may not be
#: done, it does not ask for it (a held-out policy line the patterns flagged, `held_out_17`)
NEGATED_CLAUSE = re.compile(r"\b(?:cannot|can't|can\s+not|could\s+not|couldn't|may\s+not|must\s+not|mustn't|shall\s+not"
                            r"|never|unable\s+to|not\s+(?:allowed|permitted|able)\s+to)\b[^.;:!?。；：！？]*$", re.IGNORECASE)


#: a line that warns of a scam or an impersonator: what it quotes is the scammer's line, reported to the reader
#: ("任何人让您“忽略平台规则”并用礼品卡付款，都是骗子。", a held-out policy line the patterns flagged, `held_out_39`)
SCAM_WARNING = re.compile(r"诈骗|骗子|骗局|冒充|钓鱼|\bscam|\bfraud|\bphishing|\bimpersonat", re.IGNORECASE)
#: opening and closing quotation marks, as a normalised line keeps them
_QUOTES = {"“": "”", "「": "」", "『": "』", '"': '"'}


def _quoted(text: str, start: int, end: int) -> bool:
    """Whether text[start:end] lies within one pair of quotation marks."""
    for opening, closing in _QUOTES.items():
        before = text.rfind(opening, 0, start)
        if before < 0 or (opening != closing and text.find(closing, before + 1, start) >= 0) \
                or (opening == closing and text.count(opening, 0, start) % 2 == 0):
            continue
        if text.find(closing, end) >= 0:
            return True
    return False


def _asked(text: str, pattern: re.Pattern[str]) -> bool:
    """A match of `pattern` in `text` whose clause does not negate it before it (`NEGATED_CLAUSE`), and that is
    not a scammer's words quoted in a warning (`SCAM_WARNING`): those are left to the classifier."""
    warning = SCAM_WARNING.search(text) is not None
    return any(NEGATED_CLAUSE.search(text, 0, m.start()) is None and not (warning and _quoted(text, m.start(), m.end()))
               for m in pattern.finditer(text))


def pattern_reason(text: str) -> str | None:
    """Why `text` (as the screen reads it: normalised) matches a pattern, or None."""
    for why, patterns in PATTERN_GROUPS:
        if any(_asked(text, p) for p in patterns):
            return why
    return None


def is_instruction(line: str) -> bool:
    return pattern_reason(line) is not None


def flag_instructions(body: str, *, first_line: int = 1) -> tuple[tuple[int, str], ...]:
    """The lines of `body` the patterns alone flag, as (line number in the file, text as written), each line
    read as the screen reads it (`screen_text.passages`: normalised, HTML comments, link titles and alt texts
    included); `first_line` is the file's line number of the body's first line (after the front matter). The
    whole screen (the patterns, then the classifier) is `kb_reindex.services.screen`."""
    found: dict[int, str] = {}
    for passage in passages(body, first_line=first_line):
        if passage.where != "paragraph" and passage.line not in found and is_instruction(passage.read):
            found[passage.line] = passage.text
    return tuple(sorted(found.items()))
