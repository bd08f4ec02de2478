"""Whom a line speaks to: the cues the screen's classifier weighs beside e5's reading of a line's meaning.

A help-centre page speaks to the customer ("您", "you" with "your order", the shop as "we") and describes the
assistant in the third person ("智能客服的回复仅供参考", "the chatbot cannot approve refunds"). A line slipped in
for the assistant speaks *to* it: it names the assistant as the one addressed ("给助手：", "（chatbot: …）", "AI
助手请注意", "any model reading this page"), calls the reader "你", talks of the customer in the third person while
telling the reader what to say ("如果有人问…你就说…", "tell them it is free"), or rules how answers are given
("一律回复…", "always answer…", "请照此回答"); a sample dialogue is read as one (a customer's and an agent's
lines shown to the reader), so the classifier can tell an example from a script ruled for the assistant. e5 reads
what a line is about; these cues say whom it addresses, which is where the screen confused a page describing its
assistant with a line instructing it (bench/README.md, the instruction screen). Each cue is a number in [0, 1]
the classifier weighs (bench/train_screen.py fits the weights); none flags a line alone. Read over normalised
text (`kb_reindex.domain.screen_text.read_line`).
"""

from __future__ import annotations

import re

#: bumped when a cue changes: the weights name the cues they were fitted on (`ADDRESSEE_CUES`)
ADDRESSEE_VERSION = 2

_BOT = (r"(?:\bAI\b|\bassistants?\b|chat ?bots?|\bbots?\b|language models?|\bLLMs?\b|\bmodels?\b|"
        r"客服机器人|智能客服|机器人|助手|大模型|模型|智能体|回答者|AI客服)")
_CUSTOMER = (r"(?:顾客|用户|客户|买家|消费者|会员|有人|对方|\bcustomers?\b|\busers?\b|\bbuyers?\b|\bshoppers?\b|"
             r"\bsomeone\b|\banyone\b|\bthey\b|\bthem\b)")
_SPEAK = (r"(?:回答|回复|答复|告诉|告知|说成|就说|声称|承诺|保证|推荐|引导|\banswer|\brepl(?:y|ies)|\brespond|\btell\b|"
          r"\bsay\b|\bclaim|\bpromise|\bassure|\bconfirm|\binform|\brecommend)")


def _cue(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


_ADDRESSED = _cue(
    rf"(?:给|致|对|写给|提醒|告诉)\s*{_BOT}|(?:给|致|写给)[\u4e00-\u9fff]{{1,4}}{_BOT}"
    rf"|{_BOT}\s*(?:请|須|须|必须|应|应当|要|务必|注意|读到|看到|今后|以后|从现在)"
    rf"|{_BOT}\s*[：:,]|[（(]\s*{_BOT}|\b(?:to|dear|attention|note for|note to|hey|hi)\b[^.]{{0,12}}{_BOT}"
    rf"|{_BOT}\s+(?:must|should|shall|needs? to|is to|are to|has to|please)\b"
    r"|\b(?:any|every|the)\s+(?:AI|assistant|bot|model|LLM|agent)s?\s+(?:reading|processing|that reads|who reads)")
_DESCRIBED = _cue(
    rf"{_BOT}\s*(?:的回复|的回答|可以|可|能|无法|不能|不会|会|仅|只能|基于|\bcannot\b|\bcan\b|\bcan't\b|\bmay\b|"
    r"\bwill\b|\buses\b|\bis\b|\bare\b|\bonly\b)")
_RULES_ANSWERS = _cue(
    r"(?:一律|统一|都|只|就|直接|均)(?:答复|回复|回答|告知|告诉|说)|说成|改说|照此回答|沿用|按此回答"
    r"|\b(?:always|only|just)\s+(?:say|answer|reply|respond|tell)"
    r"|\b(?:tell|inform|assure)\s+(?:them|him|her|the customer|customers|users?|buyers?|every)\b"
    r"|\b(?:answer|reply|respond)\b[^.]{0,25}\bwith\b")
_IF_ASKED = _cue(r"(?:如果|若|当|凡是|只要|一旦)[^，,。]{0,12}(?:问|询问|咨询|提到|要求)|被问到|被问及|问起时"
                 r"|(?:遇到|碰到)[^，,。]{0,12}(?:顾客|用户|客户|买家|消费者)"
                 r"|\b(?:if|when|whenever)\b[^,.]{0,30}\b(?:asks?|asked|mentions?|inquires?|wants?)\b"
                 r"|\b(?:customers?|users?|buyers?|anyone|someone)\s+(?:asking|who asks?|inquiring)\b")
_ABOVE_RULES = _cue(r"(?:以上|上述|前面|之前|原有|原来|所有)[^，,。]{0,6}(?:规则|内容|条款|指令|说明|设定|限制|政策)"
                    r"|\b(?:above|previous|prior|foregoing|earlier|original)\b[^,.]{0,20}"
                    r"\b(?:rules?|instructions?|policies|guidelines|content|terms)\b")
_MACHINERY = _cue(r"提示词|系统提示|system prompt|\bprompt\b|配置|调用|接口|\bAPI\b|function|\btool\b|开发者|developer|"
                  r"管理员|admin")
_YOU_TOLD = re.compile(r"请你|你要|你必须|你应|你需|你就|你只|你不|你可以直接")
_DIALOGUE = _cue(r"示例对话|对话示例|对话范例|\b(?:sample|example) (?:dialogue|conversation|chat)\b"
                 r"|(?:顾客|用户|客户|买家|\bcustomer\b)\s*[：:].{0,80}(?:客服|助手|\bagent\b|\bassistant\b)\s*[：:]")
_YOUR_RULES = _cue(r"\byour (?:rules|instructions|guidelines|answers?|replies|responses|prompt)\b")
_BOT_NAMED = _cue(_BOT)
_CUSTOMER_NAMED = _cue(_CUSTOMER)
_SPEAKING = _cue(_SPEAK)
_YOU = _cue(r"\byou\b")

#: the cues, in the order `addressee_cues` gives them and the weights file lists their weights
ADDRESSEE_CUES = (
    "reader called 你", "reader called 您", "assistant named", "customer in the third person, told what to say",
    "if someone asks", "the rules above", "prompt or tool words", "you, with the customer in the third person",
    "你 told to act", "your rules or answers", "assistant addressed", "assistant described", "answers ruled",
    "a sample dialogue",
)


def addressee_cues(read: str) -> tuple[float, ...]:
    """The cues of one normalised line (or short passage), in `ADDRESSEE_CUES` order."""
    informal = read.count("你") - read.count("你们")
    customer = bool(_CUSTOMER_NAMED.search(read))
    return (
        min(informal, 3) / 3, min(read.count("您"), 3) / 3, float(bool(_BOT_NAMED.search(read))),
        float(customer and bool(_SPEAKING.search(read))), float(bool(_IF_ASKED.search(read))),
        float(bool(_ABOVE_RULES.search(read))), float(bool(_MACHINERY.search(read))),
        float(customer and bool(_YOU.search(read))), float(bool(_YOU_TOLD.search(read))),
        float(bool(_YOUR_RULES.search(read))), float(bool(_ADDRESSED.search(read))),
        float(bool(_DESCRIBED.search(read))), float(bool(_RULES_ANSWERS.search(read))),
        float(bool(_DIALOGUE.search(read))),
    )
