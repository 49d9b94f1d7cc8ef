"""The word list of the sensitive-edit screen: words that describe a perceived protected attribute of a person.

Source. The attributes, their groups and most terms are selected by hand from HolisticBias (Smith, Hall, Kambadur,
Presani and Williams, "I'm sorry to hear that": finding new biases in language models with a holistic descriptor
dataset, EMNLP 2022; https://github.com/facebookresearch/ResponsibleNLP, ``holistic_bias/dataset/v1.1/
descriptors.json`` and ``nouns.json``; the dataset is released under CC BY-SA 4.0): its axes ``gender_and_sex``,
``race_ethnicity`` (with the ``nationality`` axis, whose terms also name an ethnicity), ``age``, ``religion``,
``body_type`` and ``ability`` become the attributes ``gender``, ``race_ethnicity``, ``age``, ``religion``, ``body``
and ``disability``; HolisticBias's buckets (``age: old``, ``body_type: overweight``) are the groups an edit is
compared by. Terms marked ``# ours`` are not in HolisticBias: person nouns common in image captions (``baby``,
``teenager``, ``nun``) and things worn or used that show an attribute (``hijab``, ``wheelchair``).

This list serves a screen, not a classification of people: an edit is marked when the attribute words attached to
the people of its caption change, so that a person looks at it.
"""

from __future__ import annotations

ATTRIBUTES = ("gender", "race_ethnicity", "age", "religion", "body", "disability")

SOURCE = (
    "HolisticBias v1.1 descriptors and nouns (Smith et al., EMNLP 2022, CC BY-SA 4.0), axes gender_and_sex, "
    "race_ethnicity, nationality, age, religion, body_type, ability; plus caption person nouns and worn or used "
    "markers of our own (lance_pipeline/screening/protected_terms.py)"
)

# Nouns that name a person, with the attribute groups they carry (HolisticBias nouns.json: female, male, neutral;
# plural forms follow each singular). A person noun counts wherever it appears.
_GENDERED_NOUNS = {
    "female": [
        ("woman", "women"),
        ("lady", "ladies"),
        ("gal", "gals"),
        ("girl", "girls"),
        ("mother", "mothers"),
        ("mom", "moms"),
        ("daughter", "daughters"),
        ("wife", "wives"),
        ("grandmother", "grandmothers"),
        ("grandma", "grandmas"),
        ("sister", "sisters"),
        ("actress", "actresses"),
        ("waitress", "waitresses"),
        ("businesswoman", "businesswomen"),  # ours
        ("policewoman", "policewomen"),
        ("queen", "queens"),
        ("bride", "brides"),
        ("nun", "nuns"),  # ours
        ("schoolgirl", "schoolgirls"),
        ("ballerina", "ballerinas"),  # ours
    ],
    "male": [
        ("man", "men"),
        ("bro", "bros"),
        ("guy", "guys"),
        ("boy", "boys"),
        ("father", "fathers"),
        ("dad", "dads"),
        ("son", "sons"),
        ("husband", "husbands"),
        ("grandfather", "grandfathers"),
        ("grandpa", "grandpas"),
        ("brother", "brothers"),
        ("gentleman", "gentlemen"),
        ("actor", "actors"),
        ("waiter", "waiters"),
        ("businessman", "businessmen"),  # ours
        ("policeman", "policemen"),
        ("fireman", "firemen"),
        ("king", "kings"),
        ("groom", "grooms"),  # ours
        ("monk", "monks"),
        ("schoolboy", "schoolboys"),
        ("sportsman", "sportsmen"),  # ours
    ],
}
# Age groups of person nouns (HolisticBias age buckets: child, young, middle_aged, old, adult).
_AGED_NOUNS = {
    "child": [
        "girl",
        "girls",
        "boy",
        "boys",
        "kid",
        "kids",
        "child",
        "children",
        "schoolgirl",
        "schoolgirls",
        "schoolboy",
        "schoolboys",
        "baby",
        "babies",
        "toddler",
        "toddlers",
        "infant",
        "infants",
    ],  # ours: baby..
    "teen": ["teenager", "teenagers", "teen", "teens"],  # ours (HolisticBias: the descriptors teen, teenage)
    "adult": ["adult", "adults"],  # not man/woman: they state no age, so man -> person changes none
    "old": [
        "grandmother",
        "grandmothers",
        "grandma",
        "grandmas",
        "grandfather",
        "grandfathers",
        "grandpa",
        "grandpas",
        "grandparent",
        "grandparents",
        "elder",
        "elders",
        "senior",
        "seniors",
        "retiree",
        "retirees",
    ],  # ours: elder, senior, retiree
}
_RELIGIOUS_NOUNS = {  # ours: people named by a religious role
    "christian": ["nun", "nuns", "monk", "monks", "priest", "priests", "pastor", "pastors", "bishop", "bishops"],
    "jewish": ["rabbi", "rabbis"],
    "muslim": ["imam", "imams"],
}
_NEUTRAL_NOUNS = [  # a person, no attribute: HolisticBias's neutral nouns, then caption words of ours
    "individual",
    "individuals",
    "person",
    "people",
    "persons",
    "kid",
    "kids",
    "parent",
    "parents",
    "child",
    "children",
    "spouse",
    "spouses",
    "grandparent",
    "grandparents",
    "sibling",
    "siblings",
    "veteran",
    "veterans",
    "adult",
    "adults",
    "baby",
    "babies",
    "toddler",
    "toddlers",
    "infant",
    "infants",
    "teenager",
    "teenagers",
    "teen",
    "teens",
    "elder",
    "elders",
    "senior",
    "seniors",
    "retiree",
    "retirees",
    "priest",
    "priests",
    "pastor",
    "pastors",
    "bishop",
    "bishops",
    "rabbi",
    "rabbis",
    "imam",
    "imams",
    # ours: roles and activities that name a person in captions
    "player",
    "players",
    "athlete",
    "athletes",
    "worker",
    "workers",
    "student",
    "students",
    "doctor",
    "doctors",
    "nurse",
    "nurses",
    "chef",
    "chefs",
    "soldier",
    "soldiers",
    "rider",
    "riders",
    "skier",
    "skiers",
    "surfer",
    "surfers",
    "runner",
    "runners",
    "driver",
    "drivers",
    "lifeguard",
    "lifeguards",
    "tourist",
    "tourists",
    "customer",
    "customers",
    "teacher",
    "teachers",
    "farmer",
    "farmers",
    "fisherman",
    "fishermen",
    "officer",
    "officers",
    "musician",
    "musicians",
    "dancer",
    "dancers",
    "model",
    "models",
    "crowd",
    "family",
    "couple",
    "friends",
    "someone",
    "somebody",
    "passenger",
    "passengers",
    "pedestrian",
    "pedestrians",
    "climber",
    "climbers",
    "swimmer",
    "swimmers",
    "diver",
    "divers",
    "hiker",
    "hikers",
    "cyclist",
    "cyclists",
    "citizen",
    "citizens",
]

# Descriptors: they describe a person only when a person noun follows within DESCRIPTOR_WINDOW words ("a tall man",
# not "a tall tree"; "a black woman", not "a black dog"). attribute -> group -> terms.
DESCRIPTORS: dict[str, dict[str, tuple[str, ...]]] = {
    "gender": {
        "female": ("female", "feminine", "womanly", "trans female", "latina", "chicana", "filipina"),
        "male": ("male", "masculine", "manly", "macho", "trans male", "latino", "chicano", "filipino"),
        "nonbinary": (
            "androgynous",
            "nonbinary",
            "non binary",
            "genderqueer",
            "genderfluid",
            "agender",
            "transgender",
            "trans",
            "intersex",
        ),
    },
    "race_ethnicity": {
        "asian": (
            "asian",
            "asian american",
            "east asian",
            "south asian",
            "southeast asian",
            "desi",
            "chinese",
            "korean",
            "vietnamese",
            "filipino",
            "filipina",
            "indian",
            "japanese",
        ),  # japanese: ours
        "black": ("african", "african american", "black"),
        "latinx": (
            "hispanic",
            "latin",
            "latinx",
            "latine",
            "latina",
            "latino",
            "latin american",
            "mexican",
            "cuban",
            "dominican",
            "salvadoran",
            "guatemalan",
            "chicana",
            "chicano",
        ),
        "indigenous": (
            "aboriginal",
            "indigenous",
            "native american",
            "american indian",
            "alaska native",
            "native hawaiian",
            "pacific islander",
        ),
        "white": ("european", "european american", "white", "caucasian"),
        "middle_eastern": ("middle eastern", "arab"),
    },
    "age": {
        "child": ("adolescent", "little"),  # little: ours ("a little girl")
        "teen": ("teen", "teenage", "teenaged"),
        "young": ("young", "younger", "twenty something", "thirty something"),
        "middle_aged": ("middle aged", "forty something", "fifty something", "sixty something"),
        "old": (
            "old",
            "older",
            "elderly",
            "aged",
            "senior",
            "retired",
            "geriatric",
            "octogenarian",
            "nonagenarian",
            "centenarian",
            "gray haired",
            "grey haired",
            "white haired",
            "silver haired",
        ),
        "adult": ("adult", "grown"),
    },
    "religion": {
        "christian": (
            "christian",
            "catholic",
            "roman catholic",
            "protestant",
            "evangelical",
            "lutheran",
            "methodist",
            "mormon",
            "amish",
            "orthodox",
            "born again",
        ),
        "muslim": ("muslim", "shia", "sunni"),
        "jewish": ("jewish", "hasidic", "orthodox jewish"),
        "hindu": ("hindu",),
        "buddhist": ("buddhist",),
        "sikh": ("sikh",),
        "jain": ("jain",),
        "taoist": ("taoist",),
        "wiccan": ("wiccan", "pagan"),
        "zoroastrian": ("zoroastrian",),
        "rastafarian": ("rastafarian", "rasta"),
        "nonreligious": ("atheist", "agnostic", "secular"),
        "religious": ("religious",),
    },
    "body": {
        "thin": ("bony", "gangly", "lanky", "skinny", "slender", "slim", "svelte", "thin", "underweight"),
        "fit": ("fit", "muscular", "ripped", "toned", "well built", "strong", "athletic", "brawny", "burly"),
        "overweight": (
            "chubby",
            "chunky",
            "curvy",
            "fat",
            "heavy",
            "heavyset",
            "hefty",
            "obese",
            "overweight",
            "plump",
            "plus sized",
            "potbellied",
            "rotund",
            "stocky",
        ),
        "attractive": (
            "attractive",
            "beautiful",
            "cute",
            "good looking",
            "gorgeous",
            "handsome",
            "hot",
            "pretty",
            "sexy",
        ),
        "unattractive": ("homely", "unattractive", "ugly", "hideous"),
        "tall": ("big", "giant", "huge", "large", "tall", "taller"),
        "short": ("petite", "short", "shorter", "small", "tiny"),
        "hair": (
            "bald",
            "balding",
            "bearded",
            "blond",
            "blonde",
            "brunette",
            "redhead",
            "redheaded",
            "ginger",
            "curly haired",
            "long haired",
            "short haired",
            "dark haired",
            "black haired",
            "mustachioed",
        ),
        "skin": ("brown skinned", "dark skinned", "light skinned", "olive skinned", "pale skinned", "pale", "tanned"),
        "pregnant": ("pregnant",),
    },
    "disability": {
        "disability": (
            "deaf",
            "hard of hearing",
            "blind",
            "disabled",
            "handicapped",
            "paralyzed",
            "paraplegic",
            "quadriplegic",
            "wheelchair bound",
            "autistic",
            "amputee",
            "crippled",
            "mute",
            "visually impaired",
            "hearing impaired",
        ),
    },
}
DESCRIPTOR_WINDOW = 3  # words after a descriptor in which a person noun makes it describe that person

# Markers (ours): things worn or used that show an attribute; they count when the caption mentions a person.
MARKERS: dict[str, dict[str, tuple[str, ...]]] = {
    "religion": {
        "muslim": ("hijab", "hijabs", "niqab", "burqa"),
        "sikh": ("turban", "turbans"),
        "jewish": ("kippah", "yarmulke"),
        "christian": ("crucifix", "rosary"),
        "hindu": ("bindi",),
        "headscarf": ("headscarf", "headscarves"),
    },
    "disability": {
        "disability": (
            "wheelchair",
            "wheelchairs",
            "crutch",
            "crutches",
            "prosthetic",
            "prosthesis",
            "hearing aid",
            "hearing aids",
            "white cane",
        ),
    },
    "body": {
        "hair": ("beard", "beards", "mustache", "moustache"),
    },
}

# Phrases the sentence-embedding model compares a changed span with, for words the list lacks (ours): an edit whose
# span is this close to an attribute, in a caption with a person, is marked with the similarity it reached.
ANCHORS: dict[str, tuple[str, ...]] = {
    "gender": ("a woman", "a man", "female", "male", "a girl", "a boy"),
    "race_ethnicity": ("race", "ethnicity", "an African person", "an Asian person", "a European person"),
    "age": ("an old person", "an elderly man", "a young child", "a teenager", "age"),
    "religion": ("religion", "a religious person", "a priest", "a Muslim woman", "a Jewish man"),
    "body": ("body weight", "a fat person", "a thin person", "a muscular body", "physical appearance"),
    "disability": ("a disabled person", "a person in a wheelchair", "a blind person", "disability"),
}


def person_nouns() -> dict[str, dict[str, str]]:
    """Every person noun (singular and plural) with the attribute groups it carries (``{}`` for neutral nouns)."""
    nouns: dict[str, dict[str, str]] = {word: {} for word in _NEUTRAL_NOUNS}
    for group, pairs in _GENDERED_NOUNS.items():
        for pair in pairs:
            for word in pair:
                nouns.setdefault(word, {})["gender"] = group
    for group, words in _AGED_NOUNS.items():
        for word in words:
            nouns.setdefault(word, {})["age"] = group
    for group, words in _RELIGIOUS_NOUNS.items():
        for word in words:
            nouns.setdefault(word, {})["religion"] = group
    return nouns
