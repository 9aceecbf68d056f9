"""Seeded generators for the categories that need fresh numbers or passages: math, reasoning, summarization.

A fixed list of word problems would teach the head one answer per question; drawing the numbers, names
and passage sentences from a seeded RNG makes the target actually compute and paraphrase, which is the
token distribution the head has to predict at serving time. Every word here was written for this project.
Generators return texts only; ids and dedup across categories belong to the package API.
"""

from __future__ import annotations

import random
from typing import Callable

Maker = Callable[[random.Random], str]

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elif", "Femi", "Grace", "Hiro", "Ines", "Jamal", "Kai", "Lena",
         "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yara"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "March", "April", "May", "June", "September", "October", "November"]
TOWNS = ["Millbrook", "Ashford Hollow", "Port Kessel", "Larkspur", "Eddington Falls", "Brambleton", "Kestrel Bay"]


def draw(rng: random.Random, makers: list[Maker], n: int) -> list[str]:
    """Cycle through the makers until n distinct texts exist, so every kind gets an even share.

    Bounded, because a maker with a small space (a fixed puzzle with a few phrasings) saturates; the other
    makers then fill its share instead of the loop spinning.
    """
    out: list[str] = []
    seen: set[str] = set()
    for attempt in range(n * 50):
        text = makers[attempt % len(makers)](rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
            if len(out) == n:
                break
    return out


# --- math ---------------------------------------------------------------------------------------------

MATH_PREFIX = ["", "", "Quick math question: ", "Can you help me with this? ", "Homework check: "]
MATH_SUFFIX = ["", " Show your work.", " Explain each step briefly.", " Give just the final answer.",
               " Answer in one sentence.", " Walk me through it step by step."]


def _money(g: random.Random, lo: int, hi: int) -> str:
    return f"${g.randint(lo, hi)}.{g.choice(['00', '50', '25', '99'])}"


def _math_kinds(g: random.Random) -> list[Callable[[], str]]:
    r = g.randint
    name, other = g.sample(NAMES, 2)
    a, b, x = r(2, 12), r(2, 12), r(-9, 15)
    p = r(8, 80)
    leg_k, legs = r(1, 6), g.choice([(3, 4), (5, 12), (8, 15)])
    return [
        lambda: f"What is {g.choice([5, 10, 12, 15, 20, 25, 30, 40, 75])}% of {r(2, 60) * 10}?",
        lambda: f"A jacket costs {_money(g, 30, 150)} and is {g.choice([10, 15, 20, 25, 30, 40])}% off. "
                f"What is the sale price?",
        lambda: f"Find the average of {', '.join(str(r(1, 99)) for _ in range(r(4, 7)))}.",
        lambda: f"A train travels {r(6, 60) * 10} km in {r(2, 6)} hours. What is its average speed?",
        lambda: f"Solve for x: {a}x + {b} = {a * x + b}.",
        lambda: f"A rectangle is {r(3, 25)} cm wide and {r(3, 40)} cm long. What are its area and perimeter?",
        lambda: f"What is the area of a circle with a radius of {r(2, 20)} cm? Use 3.14 for pi.",
        lambda: f"What is {r(1, 5)}/{r(6, 9)} + {r(1, 3)}/{g.choice([2, 4, 5, 10])}? Simplify the result.",
        lambda: f"If I put ${r(5, 50) * 100} in a savings account at {r(2, 7)}% simple interest per year, "
                f"how much interest do I earn in {r(2, 10)} years?",
        lambda: f"A recipe uses flour and sugar in a ratio of {a}:{b}. If I use {a * r(2, 6) * 50} grams of "
                f"flour, how much sugar do I need?",
        lambda: f"Find the greatest common divisor and the least common multiple of {r(2, 30) * 2} and "
                f"{r(2, 30) * 3}.",
        lambda: f"How many minutes are in {r(2, 9)} hours and {r(5, 55)} minutes?",
        lambda: f"{name} buys {r(2, 9)} notebooks at {_money(g, 1, 6)} each and pays with a "
                f"${g.choice([20, 50, 100])} bill. How much change does {name} get?",
        lambda: f"Compute {r(12, 99)} x {r(12, 99)}.",
        lambda: f"What is {r(11, 40)} squared minus {r(2, 10)} squared?",
        lambda: f"A bag has {a} red marbles and {b} blue marbles. What is the probability of drawing a red one?",
        lambda: f"What is the sum of all whole numbers from 1 to {r(10, 200)}?",
        lambda: f"A movie starts at {r(1, 11)}:{g.choice(['00', '15', '30', '45'])} pm and lasts {r(85, 170)} "
                f"minutes. What time does it end?",
        lambda: f"{name} is {b} years older than {other}. Their ages add up to {2 * r(5, 40) + b}. "
                f"How old is each of them?",
        lambda: f"A right triangle has legs of {legs[0] * leg_k} and {legs[1] * leg_k}. "
                f"How long is the hypotenuse?",
        lambda: f"One pipe fills a tank in {a} hours and another fills it in {a + r(1, 6)} hours. "
                f"How long do they take together?",
        lambda: f"The price of a ticket went from ${p} to ${p + r(1, p)}. What is the percent increase?",
        lambda: f"Convert {r(2, 95) / 10} kilometers to meters.",
        lambda: f"Round {r(1000, 99999) / 100} to the nearest whole number and to one decimal place.",
        lambda: f"Is {r(20, 400)} a prime number? Explain how you checked.",
        lambda: f"{name} reads {r(8, 40)} pages a day. How many days will a {r(150, 600)}-page book take?",
        lambda: f"{name} saves ${r(5, 40)} every week. How much will {name} have saved after {r(4, 52)} weeks?",
        lambda: f"A pizza is cut into {g.choice([6, 8, 10, 12])} slices and {name} eats {r(1, 4)}. "
                f"What fraction of the pizza is left?",
    ]


def math(rng: random.Random, n: int) -> list[str]:
    count = len(_math_kinds(rng))

    def maker(i: int) -> Maker:
        return lambda g: g.choice(MATH_PREFIX) + _math_kinds(g)[i]() + g.choice(MATH_SUFFIX)

    return draw(rng, [maker(i) for i in range(count)], n)


# --- reasoning ----------------------------------------------------------------------------------------

CONDITIONALS = [  # (if p, then q, what we observed, the question) -- some valid inferences, some fallacies
    ("it rains", "the football match is cancelled", "the match was not cancelled", "did it rain"),
    ("the alarm rings", "everyone leaves the building", "everyone left the building", "did the alarm ring"),
    ("a number is divisible by 4", "it is even", "the number 14 is even", "is 14 divisible by 4"),
    ("the store is open", "the lights are on", "the lights are off", "is the store open"),
    ("Mia studies", "she passes the test", "Mia did not pass", "did Mia study"),
    ("the plant gets sunlight", "it grows", "the plant grew", "did it get sunlight"),
]
GROUPS = {
    "fruits": ["apple", "banana", "grape", "mango", "pear"], "vegetables": ["carrot", "onion", "pea", "leek"],
    "instruments": ["violin", "drum", "flute", "piano"], "planets": ["Mars", "Venus", "Jupiter", "Mercury"],
    "tools": ["hammer", "wrench", "saw", "drill"], "birds": ["robin", "eagle", "sparrow", "owl"],
    "colors": ["red", "green", "purple", "yellow"], "sports": ["tennis", "soccer", "hockey", "golf"],
}
ANALOGIES = [
    ("bird", "nest", "bee"), ("hand", "glove", "foot"), ("pen", "write", "knife"), ("fish", "water", "bird"),
    ("puppy", "dog", "kitten"), ("book", "read", "song"), ("hot", "cold", "up"), ("teacher", "school", "doctor"),
    ("day", "sun", "night"), ("painter", "brush", "writer"), ("wheel", "car", "wing"), ("seed", "tree", "egg"),
]
SCENARIOS = [
    "everyone in a town started working from home", "a city banned cars from its center", "bees disappeared",
    "the internet went down for a week", "school started an hour later", "a store gave everything away for a day",
    "the moon were twice as close", "a company doubled its prices overnight", "it never got dark",
    "everyone had to learn a second language", "a river dried up near a farming village",
]
COMPARE = [("taller", "shortest", "tallest"), ("older", "youngest", "oldest"), ("faster", "slowest", "fastest"),
           ("heavier", "lightest", "heaviest")]
RELATIONS = [("mother", "father", "grandfather"), ("father", "sister", "aunt"), ("sister", "mother", "mother"),
             ("brother", "son", "nephew")]
NONSENSE = ["bloops", "razzies", "lazzles", "glims", "zorbs", "fepps"]
REASON_SUFFIX = ["", " Explain your reasoning.", " Think step by step.", " Answer briefly, then justify it."]


def _order(g: random.Random) -> str:
    k = g.randint(3, 4)
    ppl = g.sample(NAMES, k)
    comp, low, high = g.choice(COMPARE)
    facts = [f"{ppl[i]} is {comp} than {ppl[i + 1]}" for i in range(k - 1)]
    g.shuffle(facts)
    return f"{'. '.join(facts)}. Who is the {g.choice([low, high])}?"


def _sequence(g: random.Random) -> str:
    s, d = g.randint(1, 20), g.randint(2, 9)
    kind = g.randrange(4)
    if kind == 0:
        seq = [s + d * i for i in range(5)]
    elif kind == 1:
        seq = [s * g.choice([2, 3]) ** i for i in range(5)]
    elif kind == 2:
        seq = [(s % 6 + i) ** 2 for i in range(5)]
    else:
        seq = [s, d]
        for _ in range(3):
            seq.append(seq[-1] + seq[-2])
    return f"What number comes next: {', '.join(map(str, seq))}, ...?"


def _family(g: random.Random) -> str:
    a, b, c = g.sample(NAMES, 3)
    rel = g.choice(RELATIONS)
    return f"{a} is {b}'s {rel[0]}. {c} is {a}'s {rel[1]}. What is {c} to {b}?"


def _odd_one(g: random.Random) -> str:
    cat, odd = g.sample(sorted(GROUPS), 2)
    words = g.sample(GROUPS[cat], 3) + [g.choice(GROUPS[odd])]
    g.shuffle(words)
    return f"Which one does not belong: {', '.join(words)}?"


def _syllogism(g: random.Random) -> str:
    x, y, z = g.sample(NONSENSE, 3)
    return g.choice([f"All {x} are {y}. All {y} are {z}. Are all {x} {z}?",
                     f"All {x} are {y}. Some {y} are {z}. Must some {x} be {z}?",
                     f"No {x} are {y}. All {z} are {y}. Can any {z} be {x}?"])


def _conditional(g: random.Random) -> str:
    p, q, obs, ask = g.choice(CONDITIONALS)
    return f"If {p}, then {q}. We know that {obs}. Based only on that, {ask}?"


REASON_MAKERS: list[Maker] = [
    _order, _sequence, _family, _odd_one, _syllogism, _conditional,
    lambda g: f"If today is {g.choice(DAYS)}, what day of the week will it be in {g.randint(3, 100)} days?",
    lambda g: "Complete the analogy: {} is to {} as {} is to what?".format(*g.choice(ANALOGIES)),
    lambda g: f"What would probably happen if {g.choice(SCENARIOS)}? Give two likely effects.",
    lambda g: f"A farm has {g.randint(2, 30)} chickens and {g.randint(1, 15)} cows. How many legs are there?",
    lambda g: f"At a party, {g.randint(3, 15)} people each shake hands once with every other person. "
              f"How many handshakes happen?",
    lambda g: (lambda n, d: f"I have {n + d} coins, only nickels and dimes, worth {5 * n + 10 * d} cents. "
                            f"How many of each do I have?")(g.randint(2, 9), g.randint(2, 9)),
    lambda g: f"In a race, you overtake the person in {g.choice(['second', 'third', 'last'])} place. "
              f"What place are you in now?",
    lambda g: f"{g.choice(NAMES)} is in line at a shop. There are {g.randint(2, 9)} people ahead and "
              f"{g.randint(2, 9)} behind. How many people are in the line?",
]


def reasoning(rng: random.Random, n: int) -> list[str]:
    makers = [(lambda m: lambda g: m(g) + g.choice(REASON_SUFFIX))(m) for m in REASON_MAKERS]
    return draw(rng, makers, n)


# --- summarization ------------------------------------------------------------------------------------
# Each passage kind: slot values, lead sentences, body sentences (3-5 kept, in order), closing sentences.
# Sampling sentences as well as fillers keeps passages from sharing one skeleton.

PASSAGES = [
    dict(slots={"proj": ["a new public library", "protected bike lanes", "a weekend farmers' market",
                         "repairs to the old stone bridge", "a community solar farm", "a bigger skate park"],
                "votes": ["5 to 4", "6 to 3", "7 to 2", "8 to 1"]},
         lead=["The town council of {town} voted {votes} on {day} to fund {proj}.",
               "{town} will get {proj} after a council vote on {day} night.",
               "After months of debate, {town} has approved plans for {proj}."],
         body=["The plan is expected to cost about ${big},000.", "Work should begin in {month} and take about "
               "{small} months.", "Supporters said it would make the town more pleasant for families.",
               "Some residents asked whether the money should go to schools instead.",
               "Council member {who} called the decision a good day for {town}.",
               "Shop owners hope the project will bring more visitors downtown.",
               "A survey last year found that {pct} percent of residents wanted the change."],
         close=["An open meeting to answer questions will be held next month.",
                "Residents can send comments to the town office until the end of {month}."]),
    dict(slots={"co": ["Norvale", "Brightpath", "Quillon", "Tidewell", "Osprey Labs", "Fernwick"],
                "thing": ["smart thermostat", "e-reader", "electric scooter", "fitness band", "coffee grinder",
                          "robot vacuum"]},
         lead=["{co} announced a new {thing} this week.", "The company {co} has revealed its latest {thing}.",
               "On {day}, {co} showed a {thing} it has been working on for {small} years."],
         body=["It will sell for ${price} starting in {month}.", "The company says the battery lasts {pct} "
               "percent longer than the previous model.", "Early reviewers praised the simple design.",
               "Some testers said the setup instructions were confusing.",
               "It comes in {small} colors, including a bright green.",
               "{co} says the case is made partly from recycled plastic.",
               "Product manager {who} said the team focused on making it quiet and easy to repair."],
         close=["A software update is promised before launch.", "Pre-orders open next week."]),
    dict(slots={"topic": ["short afternoon naps", "houseplants in offices", "walking meetings",
                          "reading aloud to young children", "ten minutes of daily stretching",
                          "writing a to-do list each evening"],
                "measure": ["memory test scores", "reported stress", "the number of new ideas", "sleep quality",
                            "focus during the day"],
                "group": ["adults", "office workers", "university students", "families", "retired people"]},
         lead=["A new study of {big} {group} asked whether {topic} had any effect on {measure}.",
               "Researchers in {town} tested how {topic} might change {measure}.",
               "Can {topic} improve {measure}? A team led by Dr. {who} tried to find out."],
         body=["The study lasted {small} weeks.", "Half of the participants tried {topic}, and the other half "
               "kept their usual routine.", "The group that tried {topic} improved by about {pct} percent.",
               "The difference was small but showed up in most age groups.",
               "The researchers warned that people knew which group they were in, which could affect the results.",
               "Dr. {who} called the results encouraging but not final."],
         close=["A larger study is planned for next year.", "The team says more research is needed."]),
    dict(slots={"team": ["design", "marketing", "support", "engineering", "sales", "events"],
                "item": ["the product launch", "the website redesign", "the summer newsletter",
                         "the customer survey", "the office move"]},
         lead=["At {day}'s {team} team meeting, the group discussed {item}.",
               "The {team} team met on {day} to review progress on {item}."],
         body=["The team agreed to push {item} back by {small} weeks.",
               "{who} will update the schedule and tell the other teams.",
               "{who2} pointed out that the budget is {pct} percent over plan.",
               "Everyone agreed that testing needs more time.", "{who2} will collect new cost estimates by Friday.",
               "The group decided to hire a part-time helper for {small} months.",
               "Moving meetings to the afternoon was discussed, but no decision was made."],
         close=["The next meeting is on Thursday at 10 am.", "{who} will send a summary to the department."]),
    dict(slots={"place": ["the swimming pool", "the main office", "the parking garage", "the science lab",
                          "the community center"]},
         lead=["{place} will be closed from {day} for cleaning and repairs.",
               "Please note that {place} is closed for maintenance starting {day}.",
               "Starting this {day}, {place} will be closed for about {small} days."],
         body=["During this time, visitors should use the side entrance.",
               "Staff can still be reached by phone between 9 am and 4 pm.",
               "The work includes new lighting and a fresh coat of paint.",
               "Anyone with a booking will receive an email with a new date.",
               "Parking nearby may be limited while workers are on site.",
               "The repairs were planned after an inspection in {month}."],
         close=["We apologize for the inconvenience.", "Questions can be sent to the front desk."]),
    dict(slots={"team": ["the Millbrook Otters", "the Larkspur Foxes", "the Brambleton Bears"],
                "rival": ["the Port Kessel Gulls", "the Kestrel Bay Hawks", "the Ashford Rangers"],
                "score": ["2-1", "3-1", "1-0", "4-2", "3-2"], "nth": ["third", "fourth", "fifth", "sixth"]},
         lead=["{team} beat {rival} {score} on {day} in front of a home crowd.",
               "In a close soccer match on {day}, {team} defeated {rival} {score}.",
               "{team} won their {nth} game of the season, beating {rival} {score}."],
         body=["{rival} scored first, early in the match.", "{who}, the team's youngest player, scored the "
               "winning goal.", "The coach said the players had worked hard on defense all week.",
               "Rain made the field slippery in the second half.",
               "One of the visiting players was sent off after a rough tackle.",
               "Around {big} fans attended, a record for the season."],
         close=["The next match is away from home on {day}.", "The coach gave the players a day off to rest."]),
    dict(slots={"job": ["baker", "bus driver", "music teacher", "librarian", "nurse", "carpenter"],
                "act": ["started a free reading club for children", "collected winter coats for families in need",
                        "taught free guitar lessons in the park", "repaired old bikes and gave them away"]},
         lead=["{who} has worked as a {job} in {town} for {small} years.",
               "Meet {who}, a {job} from {town} who {act}.",
               "For {who}, a {job} in {town}, helping others has always come naturally."],
         body=["It started as a small idea shared with a friend, {who2}.",
               "Within a few months, more than {big} people had taken part.",
               "The local newspaper wrote about it in {month}.",
               "{who} says the hardest part was finding enough volunteers.",
               "Neighbors describe {who} as patient, funny, and always on time.",
               "The town gave {who} a community award this spring."],
         close=["{who} hopes to keep the project going for many years.",
                "Next, {who} wants to start something similar in a nearby town."]),
    dict(slots={"isle": ["the island of Tellan", "Corvo Key", "the village of Santarra", "the island of Brisa"],
                "feature": ["white sand beaches", "old stone lighthouses", "hot springs", "steep hiking trails"]},
         lead=["{isle} is a small, quiet place known for its {feature}.",
               "Few travelers have heard of {isle}, but its {feature} are worth the trip.",
               "Visitors to {isle} usually come for the {feature}."],
         body=["It can only be reached by ferry, which runs {small} times a week.",
               "About {big} people live there all year.", "Summers are warm and dry, and winters are mild.",
               "The morning market sells fresh fish, bread, and honey.",
               "There are no cars, so most people walk or ride bicycles.",
               "The best time to visit is late spring, before the crowds arrive.",
               "A small museum tells the story of the first settlers."],
         close=["Hotels are few, so travelers should book early.", "Many visitors come back every year."]),
]

ANIMALS = {
    "octopus": ["has eight arms", "has three hearts", "can change the color of its skin",
                "can squeeze through very small gaps", "squirts ink to escape danger"],
    "honeybee": ["lives in colonies of thousands", "shares directions to flowers with a waggle dance",
                 "makes honey from flower nectar", "helps pollinate many crops"],
    "camel": ["can go many days without drinking", "stores fat in its hump", "has long eyelashes that keep out sand",
              "has wide feet that do not sink into sand"],
    "penguin": ["cannot fly", "uses its wings to swim", "lives mostly in the Southern Hemisphere",
                "huddles with others to stay warm"],
    "owl": ["hunts mostly at night", "can turn its head very far around", "flies almost silently",
            "has excellent hearing"],
    "elephant": ["is the largest land animal", "uses its trunk to drink and grab food",
                 "lives in family groups led by an older female", "flaps its ears to cool down"],
    "hummingbird": ["can hover in place", "beats its wings very fast", "drinks nectar from flowers",
                    "can fly backwards"],
}

SUMMARY_ASKS = [
    "Summarize the following passage in one sentence.", "Give a 3-bullet summary of this text.",
    "TL;DR this in under 25 words.", "Summarize this for a busy reader in two sentences.",
    "What is the main point of this passage?", "Write a headline and a one-sentence summary for this.",
    "Summarize this in simple words a child could understand.", "List the key facts from this passage.",
    "Summarize this text in one short paragraph.", "Who is involved, what happened, and when? Answer briefly.",
    "Give me the two most important points from this passage.", "Summarize this in no more than three sentences.",
]
FRAMES = ["{ask}\n\n{text}", "{ask}\n\n{text}", "{text}\n\n{ask}", "Text: {text}\n\nTask: {ask}",
          'Here is a passage:\n"""\n{text}\n"""\n{ask}']


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _passage(g: random.Random, spec: dict) -> str:
    who, who2 = g.sample(NAMES, 2)
    vals = {k: g.choice(v) for k, v in spec["slots"].items()}
    vals.update(who=who, who2=who2, day=g.choice(DAYS), month=g.choice(MONTHS), town=g.choice(TOWNS),
                small=g.randint(2, 9), big=g.randint(2, 90) * 10, pct=g.randint(5, 40),
                price=g.randint(3, 30) * 10 - 1)
    body = spec["body"]
    keep = sorted(g.sample(range(len(body)), g.randint(3, min(5, len(body)))))
    parts = [g.choice(spec["lead"])] + [body[i] for i in keep]
    if g.random() < 0.6:
        parts.append(g.choice(spec["close"]))
    return " ".join(_cap(s.format(**vals)) for s in parts)


def _animal(g: random.Random) -> str:
    name = g.choice(sorted(ANIMALS))
    f = g.sample(ANIMALS[name], 4)
    lead = g.choice([f"The {name} is a remarkable animal.", f"Few animals are as interesting as the {name}.",
                     f"Here are a few things to know about the {name}."])
    return f"{lead} It {f[0]}. It also {f[1]}. In addition, it {f[2]}, and it {f[3]}."


def summarization(rng: random.Random, n: int) -> list[str]:
    kinds: list[Maker] = [(lambda s: lambda g: _passage(g, s))(s) for s in PASSAGES] + [_animal]

    def maker(kind: Maker) -> Maker:
        return lambda g: g.choice(FRAMES).format(ask=g.choice(SUMMARY_ASKS), text=kind(g))

    return draw(rng, [maker(k) for k in kinds], n)
