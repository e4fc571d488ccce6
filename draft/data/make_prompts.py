"""Run as ``python3 draft/data/make_prompts.py``; its output, ``distill_prompts_mix.txt``, is committed.

Writes ``draft/data/distill_prompts_mix.txt``, one English user instruction per line: 700 distinct prompts in each
of eight categories (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities), interleaved so that
any prefix of the file is a balanced mix. SmolLM2-135M-Instruct answers them and its answers become the training
text of the speculative-decoding draft, so the prompts imitate varied, realistic chat requests (multi-part asks,
concrete names and numbers, length and format constraints, inline passages to extract facts from) rather than one
template with a swapped noun. Everything is drawn from the templates and lists below with ``random.Random(0)``, so
re-running the script reproduces the file byte for byte; it needs only the standard library.
"""
import random
import re
from pathlib import Path

OUT = Path(__file__).with_name("distill_prompts_mix.txt")
PER_CATEGORY = 700
CHATTY = {"writing", "reasoning", "math", "coding", "stem", "humanities"}
SLOT = re.compile(r"\{([^{}]*)\}")
NUMBER = re.compile(r"(_?)(\w+):(-?\d+)\.\.(-?\d+)")

LISTS = """
name: Alice | Bob | Priya | Mateo | Chen | Fatima | Liam | Sofia | Kenji | Amara | Noah | Olga | Diego | Aisha | Tom | Mei
  | Lucas | Zara | Ivan | Hana | Omar | Elena | Raj | Chloe | Kwame | Ingrid | Yusuf | Lena | Marco | Nadia | Ben | Rosa
  | Tariq | Julia | Sven | Leila | Jack | Ana | Hiro | Grace
surname: Garcia | Okafor | Lindqvist | Tanaka | Novak | Haddad | Kowalski | Nguyen | Murphy | Rossi | Mensah | Silva
city: Lisbon | Kyoto | Nairobi | Toronto | Buenos Aires | Prague | Seoul | Melbourne | Cairo | Oslo | Mexico City | Dublin
  | Edinburgh | Istanbul | Hanoi | Cape Town | Vancouver | Marrakesh | Reykjavik | Lima | Vienna | Mumbai | Chicago | Porto
  | Barcelona | Singapore | Tbilisi | Bogota | Copenhagen | Auckland | Montreal | Krakow | Havana | Budapest | Jakarta
company: Brightline Foods | Northwind Robotics | Helio Batteries | Quantia Software | Harbor Bank | Solstice Airlines
month: January | February | March | April | May | June | July | August | September | October | November | December
weekday: Monday | Tuesday | Wednesday | Thursday | Friday | Saturday | Sunday
opener: Hi! | Hello! | Quick question. | I need some help with something. | Hey there! | Could you help me out?
cons: Keep it under 150 words. | Keep it under 200 words. | Use exactly three paragraphs. | Give three concrete examples.
  | Use bullet points. | End with a one-sentence summary. | Avoid jargon. | Use a Q&A format. | Make it about 300 words.
  | Include a short table of the key points. | Write it for high-school students. | Include at least one analogy.
  | Start with a surprising fact. | Limit it to five sentences. | Add a catchy title. | Add a TL;DR line. | | |
wtopic: remote work | learning to cook at 30 | minimalism | urban gardening | new parenthood | solo travel | e-bikes
  | switching careers into tech | a first marathon | living abroad | digital detox weekends | adopting a rescue dog
  | budgeting as a student | public libraries | board games | learning piano as an adult | cycling to work | journaling
  | small-town life | volunteering at a food bank | night shifts | starting a podcast | decluttering | camping with kids
  | burnout | saving on groceries | friendship after college | meal prepping | the four-day work week | thrift shopping
  | morning routines | renovating an old house | caring for aging parents | language apps | buying a first home
audience: busy parents | college students | retirees | small business owners | software engineers | teenagers | nurses
poemform: haiku | sonnet | limerick | free-verse poem | rhyming poem with four stanzas | short ballad | acrostic poem
char: a retired astronaut | a shy baker | a talking umbrella | a teenage inventor | a lonely robot | a farmer on Mars
event: finds a map in a library book | gets a letter from the future | becomes mayor by mistake | swaps lives with a rival
rel: manager | landlord | professor | neighbor | coworker | sister | brother | best friend | client
ask: move our meeting to next {weekday} | give me {d:2..5} more days on the report | fix the faucet | review my draft by Friday
job: data analyst | graphic designer | nurse | software engineer | marketing manager | teacher | accountant | barista
field: customer service | data analysis | web development | retail | healthcare | event planning | logistics
claim: schools should start later | cities should ban cars | homework should be optional | voting should be mandatory
travelthing: street food | museums | hiking trails | local markets | architecture | nightlife | hidden cafes | cheap stays
biz: Golden Crust, a bakery | Spoke & Chain, a bike shop | Quiet Lotus, a yoga studio | Happy Paws, a dog-walking service
milestone: finished my master's degree | started a new job as a {job} | got promoted | am leaving after {y:3..12} years
genre: mystery | science fiction | fantasy | romance | horror | historical | thriller | comedy
setting: a floating city | 1920s Chicago | an Antarctic research station | a generation spaceship | a Tokyo night market
complaint: a delivery that arrived damaged | being charged twice | a rude receptionist | a laptop that died in a week
word: lantern | velvet | thunder | marmalade | compass | whisper | orbit | cinnamon | anchor | meadow
animal: fox | owl | turtle | hedgehog | whale | raccoon | octopus | penguin | wolf | parrot
startup: a volunteer-matching app | a houseplant subscription box | a used-textbook market | an AI chemistry tutor
persona: a grumpy pirate captain | a Victorian detective | a medieval blacksmith | a NASA flight director | a sommelier
  | an overexcited fitness coach | a wise old wizard | a tired barista | a 1950s radio host | a knight | a Roman senator
  | a friendly alien tourist | a strict ballet teacher | a sarcastic robot butler | a beekeeper | a kindergarten teacher
  | a noir private eye | a ship's cook | a park ranger | a carnival fortune teller | a time-traveling travel agent
  | a stand-up comedian | a museum curator | a Shakespearean actor | an Arctic explorer | a calm airline pilot | a jester
  | a chess grandmaster | a Paris hotel concierge | a retired spy | a dragon who guards a library | a sports commentator
  | a family doctor | a librarian at a school of magic | a talking dog | a Wild West sheriff | an astronaut on the ISS
situation: a job in {city} pays {p:10..40}% more | my rent is going up ${r:100..600} a month | I'm a bored {job}
histfig: Leonardo da Vinci | Marie Curie | Cleopatra | Benjamin Franklin | Ada Lovelace | Confucius | Napoleon | Mozart
tongue: Spanish | French | Japanese | German | Italian | Portuguese | Korean | Turkish | Mandarin | Swahili
dish: a mushroom risotto | a Thai green curry | a margherita pizza | shakshuka | a lemon tart | homemade ramen
nonce: blips | zorks | flurbs | quibbles | snarps | glorps
errand: pick up a prescription ready after 2 pm | mail a parcel by noon | buy ice cream | see the dentist at 11 am
fruit: apples | oranges | pears | plums | lemons | mangoes
plang: Python | JavaScript | TypeScript | C++ | Java | Go | Rust | C# | Ruby | Kotlin
ctask: checks whether a string is a palindrome | finds the missing number in 1..n | merges two sorted lists
  | counts word frequencies in a text | finds the longest common prefix of some strings | removes duplicates in order
  | checks whether two strings are anagrams | flattens a nested list | converts a Roman numeral to an integer
  | returns the k most frequent elements | validates a Sudoku board | rotates a matrix by 90 degrees | checks brackets
  | finds the second largest number | returns all primes below n | reverses the words in a sentence | chunks a list
  | finds the longest substring without repeats | computes edit distance | finds pairs that sum to a target
  | parses a query string into a map | detects a cycle in a linked list | implements binary search | formats money
bug: def is_even(n): return n % 2 == 1 | def last(items): return items[len(items)] | const s = [10, 9, 1, 25].sort();
  | def add(item, bucket=[]): bucket.append(item); return bucket | SELECT * FROM users WHERE email = NULL;
leet: merge overlapping intervals | find the fewest coins that make an amount | count the islands in a 0/1 grid
cstopic: recursion | hashing | Big O notation | how compilers work | virtual memory | neural networks | caching
gadget: wireless earbuds | robot vacuum | smartwatch | coffee grinder | e-reader | portable speaker | air fryer | keyboard
brand: Zentro | Lumio | Kestrel | Auralis | Novex | Tessel
revgood: Setup took five minutes. | The sound is crisp. | The battery lasts about {bh:6..40} hours. | It is very quiet.
revbad: the charging cable is very short | the app crashes once a week | it squeaks | the manual is confusing
xformat: as JSON | as a markdown table | as a bulleted list | in YAML | as CSV with a header row | as key: value lines
action: open a new factory | close two regional offices | buy a smaller rival | build a solar farm | recall 40,000 chargers
mtask: finish the budget draft | contact the venue | update the website | hire a designer | send out the customer survey
team: Falcons | Rovers | Tigers | Comets
item: desk lamp | USB cable | notebook | office chair | monitor stand | ink cartridge
color: black | white | navy blue | forest green | silver
comment: Arrived two days late. | Great value for the money. | Support never replied. | Broke after a week. | Works as described.
stemtopic: photosynthesis | the greenhouse effect | vaccines | plate tectonics | quantum entanglement | entropy | lasers
  | natural selection | the Doppler effect | black holes | CRISPR | batteries | enzymes | the water cycle | the Big Bang
  | special relativity | antibiotics | DNA | nuclear fusion | ocean acidification | how neurons fire | the Higgs boson
  | the heart | machine learning | the periodic table | chemical bonds | earthquakes | superconductivity | GPS
  | the nitrogen cycle | viruses | Newton's laws | the electromagnetic spectrum | the placebo effect | radioactive decay
energy: solar power | wind power | nuclear power | natural gas | hydropower | geothermal energy | coal
humtopic: the Roman Empire | women in World War II | the printing press | colonialism in Africa | the Silk Road | jazz
  | the Harlem Renaissance | the Cold War | Athenian democracy | the Industrial Revolution | the civil rights movement
  | the Meiji Restoration | the fall of the Berlin Wall | AI ethics | happiness in philosophy | Renaissance Florence
  | the spread of Buddhism | social media and democracy | the Reformation | nationalism | public education | free will
  | the partition of India | the Ottoman Empire | propaganda | modern art | the Enlightenment | the Aztec Empire
  | globalization | museums | the Black Death | the Olympic Games | human rights | the Mongol Empire | the Great Depression
histevent: the French Revolution | World War I | the fall of Rome | the Great Depression | the Reformation | the moon landing
phil: Plato | Aristotle | Confucius | Kant | John Stuart Mill | Nietzsche | Simone de Beauvoir | Hume | Hobbes | Laozi
philq: what makes an action right | justice | the purpose of government | the good life | free will | human nature
work: "Pride and Prejudice" | "1984" | "Things Fall Apart" | "Hamlet" | "The Odyssey" | "Frankenstein" | "Don Quixote"
art: Gothic cathedrals | Impressionist painting | Baroque music | Ukiyo-e prints | Pop Art | Greek tragedy | hip-hop
country: Japan | Brazil | Germany | India | Canada | Nigeria | France | Switzerland | Mexico | Sweden | South Korea
tail: Show your work. | Explain each step. | Check your answer at the end. | Explain it simply. | | |
follow: Keep it short. | Explain it as if I'm a beginner. | Mention common pitfalls. | Add a concrete example. | | |
letter: Keep it under 120 words. | Keep it short and warm. | Sound confident, not pushy. | Keep it professional. | |
rp: Stay in character no matter what. | Keep it under 150 words. | Make it funny. | Be dramatic. | | |
"""

TEMPLATES = """
[writing]
Write a {friendly|formal|humorous|inspiring|nostalgic|heartfelt} blog post about {wtopic} for {audience}. {cons}
Draft a polite email to my {rel} {name} asking them to {ask}. {letter}
Write a short story about {char} who {event}. {cons}
Write a {poemform} about {the first snow|a lighthouse keeper|city traffic at dawn|an old pair of boots|the smell of rain|a forgotten train station}.
Write a {poemform} about {wtopic} that uses the words "{word}", "{word2}" and "{word3}".
Write a product description for the {brand} {gadget}, aimed at {audience}. Keep it under {w:60..200} words and mention {k:2..4} key features.
I'm giving a {m:2..5}-minute toast at my {rel}'s {wedding|40th birthday|retirement party|graduation}. Can you write it? Mention that {we met in a chemistry class|they love terrible puns|they taught me to drive}.
Rewrite this to sound more {professional|friendly|persuasive|concise|diplomatic}, and give {k:2..4} alternatives: "{hey can u send me the file asap its kinda urgent|The meeting was bad and nobody liked it.|Your package is late because of reasons.|Please stop parking in my spot.}"
Write a cover letter for a {job} position at {company}. I have {y:2..15} years of experience in {field} and I live in {city}. {letter}
Write a persuasive speech arguing that {claim}. Give three supporting points and answer one counterargument. {cons}
Plan a {d:2..10}-day itinerary in {city} for someone who loves {travelthing} and {travelthing2}, with a rough daily budget. {cons}
Give me {k:5..12} catchy slogans for {biz}, and tell me which one you like best and why.
Write a LinkedIn post announcing that I {milestone}. Keep it humble and under {w:80..200} words.
Write a dialogue between {char} and {char2} about {wtopic}. Make it funny but end on a thoughtful note.
Write the opening paragraph of a {genre} novel set in {setting}, introducing the main character without naming them.
Write a complaint letter to {company} about {complaint}. Be firm but polite, and say what outcome I expect.
Write a review of an imaginary {genre} film called "{The Glass Orchard|Salt and Static|Echoes of Mars|Paper Lanterns}". Rate it out of 10 and avoid spoilers.
Write a thank-you note to {name} for {helping me move|the birthday gift|covering my classes while I was sick|hosting us last weekend}. {letter}
Turn the topic "{wtopic}" into a thread of {k:4..8} short social media posts, with a strong hook in the first one.
Write a bedtime story for a {a:4..9}-year-old about {char} and a {animal}. It should gently teach a lesson about {honesty|patience|kindness|courage|sharing}.
Write a job posting for a {job} at {biz} in {city}. Include responsibilities, requirements and benefits.
Write a one-page investor pitch for {startup}. Cover the problem, the solution and how it will make money. {cons}
Write a scene in which {char} discovers {a hidden room behind a bookshelf|a letter dated 100 years ago|that the stars have moved}. Use vivid sensory details and keep it under {w:150..400} words.
Outline a {k:5..10}-episode video series about {wtopic}, with a title and a one-sentence summary for each episode.
Write an apology to {name} for {missing their birthday party|not replying for a week|breaking their favorite mug}. Keep it sincere and under {w:60..150} words.
[roleplay]
Pretend you are {persona}. Describe your typical day in the first person, in under {w:100..250} words.
Act as {persona} and give me advice on {saving for a house|a noisy roommate|a job interview|stage fright|sleeping better}. Stay in character.
You are {persona}. A customer walks up and asks, "{Can I get a refund?|What do you recommend for a first-timer?|Why is this so expensive?}" Respond in character.
Act as a hiring manager interviewing me for a {job} role at {company}. Ask your first question, wait for my answer, then continue.
Roleplay as {persona} explaining {stemtopic} to a group of curious children.
Pretend you are a tour guide in {city}. Welcome our group and describe the first {k:2..4} stops of today's walking tour.
I want you to act as a {financial advisor|career counselor|lawyer|life coach}. My situation: {situation}. What would you advise, and what would you ask me first?
Be my {running coach|writing mentor|productivity coach} for the next few messages. I want to {run a 10K|write a short novel|wake up at 6 am daily} within {d:3..12} weeks. Where do we start?
Imagine you are {histfig} and you have just walked into a modern {airport|supermarket|gym|smartphone store|hospital}. Describe your reactions.
Pretend to be a customer support agent for {biz}. I'm upset about {complaint}. Handle my complaint professionally. {rp}
You are {persona}, and I am your new apprentice. Teach me the three most important rules of your trade.
You are the game master of a {genre} adventure set in {setting}. Describe the opening scene and give me three choices.
Act as a debate opponent who firmly believes that {claim}. Give your opening statement in under {w:120..250} words.
Pretend you are a {animal} living in {a coral reef|a city park|the Arctic tundra|a suburban backyard}. Tell me about your biggest worry this {spring|summer|autumn|winter}.
Stay in character as {persona} and write a short letter to your old friend {name}, who just moved to {city}.
Pretend you are {persona} on a podcast. The host asks, "{What is the hardest part of your job?|What would you tell your younger self?|What does a perfect day look like?}" Answer in character.
You are an experienced specialist. Explain to me, a nervous {patient|student|retiree|new parent}, what happens during {a root canal|an MRI scan|a court hearing|a tax audit}, and reassure me. {rp}
You are the onboard AI of a spaceship bound for {Mars|Europa|Titan|Proxima b}. The captain asks for a status report after {d:10..400} days of travel. Give it.
Pretend you are my {rel} who lives in {city}. Convince me to come and visit you this {spring|summer|autumn|winter}.
Act as a {tongue} tutor. Teach me {k:3..6} phrases for {ordering food|checking into a hotel|asking for directions|buying train tickets}, with a pronunciation guide.
You are a shopkeeper in a fantasy village, and I want to buy {a dragon egg|a map to a sunken city|a potion of courage|boots that never get wet}. Start haggling with me. {rp}
Act as a startup mentor. I'm building {startup}. Ask me {k:3..5} tough questions about my plan. {rp}
Act as a TV chef and walk your viewers through making {dish} with no more than {k:5..8} ingredients. {rp}
Pretend you're a detective investigating {a stolen painting|a missing cake at a baking contest|a jewel theft on a night train}. I am the only witness. Begin the interrogation. {rp}
I'm {name}, and tomorrow is my first day as a {job}. Pretend you are {persona} and give me a pep talk.
[reasoning]
{name} is taller than {name2}. {name3} is shorter than {name2} but taller than {name4}. Who is the second shortest? Explain.
If {a:3..9} machines make {a} parts in {a} minutes, how many minutes do {b:20..150} machines need to make {b} parts? Explain your reasoning.
A drawer holds {r:3..12} red, {b:3..12} blue and {g:2..9} green socks. In the dark, how many must I take to be sure of a matching pair? How many to be sure of two {red|blue|green} ones?
If the day before yesterday was {weekday}, what day of the week will it be {n:3..40} days from today?
You have {n:8..27} identical-looking coins, and one is slightly heavier. With a balance scale, what is the fewest number of weighings that always finds it? {tail}
In a race, {name} finished ahead of {name2} but behind {name3}. {name4} finished right after {name2}, and {name5} won. What was the finishing order?
On an island, knights always tell the truth and knaves always lie. {name} says, "{name2} and I are both knaves." What are {name} and {name2}?
Knights always tell the truth and knaves always lie. {name} says, "{name2} is a knave," and {name2} says, "{name} and I are the same type." What is each of them?
{name}, {name2}, {name3} and {name4} sit in a row of four chairs. {name} is not at either end, {name2} sits directly right of {name3}, and {name4} is at the far left. Find every possible arrangement.
Which is the odd one out: {apple, banana, carrot, grape|2, 3, 5, 9, 11|piano, violin, trumpet, painting|Mercury, Venus, Moon, Mars|shark, dolphin, whale, seal}? Could another answer be argued? {tail}
All {nonce} are {nonce2}, and some {nonce2} are {nonce3}. Does it follow that some {nonce} are {nonce3}? Explain.
Is this argument convincing? "{My grandfather smoked and lived to 95, so smoking is harmless.|Crime fell after the new mayor took office, so the mayor cut crime.|It is natural, so it must be safe.}" Name the fallacy, if any. {tail}
Today I need to {errand}, {errand2} and {errand3}. I leave home at {h:8..10} am. In what order should I do them, and why?
Help me decide between {buying a used car and leasing a new one|renting and buying a home|a better-paid job with a long commute and my current one}. Weigh the key factors and recommend one. {tail}
One of {name}, {name2} and {name3} ate the last cookie. {name} says, "It was {name2}." {name2} says, "It wasn't me." {name3} says, "It wasn't me." If exactly one of them tells the truth, who ate it?
{_d:2..7}What number comes next: {a:1..9}, {=a+d}, {=a+3*d}, {=a+6*d}, {=a+10*d}, ...? Explain the pattern.
{_m:2..3}{_c:1..5}Find the rule and the next two terms: {a:1..6}, {=a*m+c}, {=(a*m+c)*m+c}, {=((a*m+c)*m+c)*m+c}, ...
A snail at the bottom of a {h:10..30}-meter well climbs {u:3..6} meters each day and slides back {s:1..2} meters each night. On which day does it get out?
You have a {a:3..7}-liter jug and a {b:8..13}-liter jug. How can you measure exactly {c:1..6} liters, or is it impossible? Explain.
Estimate how many {piano tuners work|liters of coffee are drunk each day|taxis are on the road at rush hour} in {city}. State each assumption.
Three boxes are labeled "{fruit}", "{fruit2}" and "mixed", and every label is wrong. You may take one fruit from one box without looking inside. How do you relabel all three? {tail}
{Ice cream sales and drownings rise together|Students who eat breakfast get better grades|Cities with more firefighters have more fires}. Does one cause the other? Give other explanations. {tail}
{name}'s father is the only son of {name2}'s grandfather. How could {name} and {name2} be related? List the possibilities.
{name} lies on every {weekday} and tells the truth on all other days. On which days could {name} say "I lied yesterday"? Explain.
At a party of {n:5..15} people, everyone shakes hands once with everyone else. How many handshakes are there? Explain two ways of counting. {tail}
[math]
{name} buys {a:2..9} notebooks at ${p:2..7} each and {b:2..6} pens at ${q:1..3} each, paying with a ${=((a*p+b*q)//10+1)*10} bill. How much change does {name} get? {tail}
A jacket costs ${p:40..250}. It is discounted by {d:10..50}% and then a {t:5..12}% sales tax is added. What is the final price? {tail}
{_x:1..20}Solve for x: {a:2..12}x + {b:1..40} = {=a*x+b}. {tail}
{_x:-5..9}{_y:-5..9}Solve the system of equations {a:2..6}x + {b:2..7}y = {=a*x+b*y} and {c:2..6}x - {d:2..7}y = {=c*x-d*y}. {tail}
{_r:1..9}{_s:1..12}Find the roots of x^2 - {=r+s}x + {=r*s} = 0 and check them by substitution.
{_w:3..20}{_k:2..9}A rectangle has a perimeter of {=2*(2*w+k)} cm, and its length is {k} cm more than its width. What is its area? {tail}
What are the area and circumference of a circle with a radius of {r:2..30} cm? Use pi = 3.14. {tail}
A right triangle has legs of {a:3..24} cm and {b:4..30} cm. How long is the hypotenuse, and what is the area? {tail}
{_k:1..3}A fair coin is flipped {n:4..8} times. What is the probability of getting exactly {k} heads, and of getting no tails at all? {tail}
A bag contains {r:2..9} red, {b:2..9} blue and {g:1..6} green marbles. Two are drawn without replacement. What is the probability that both are {red|blue|green}? {tail}
An arithmetic sequence starts at {a:1..20} and has a common difference of {d:2..9}. What is term number {n:10..60}, and what is the sum of the first {n} terms?
{_t:2..6}{_v:40..90}{_u:50..120}Two trains start {=(u+v)*t} km apart and travel toward each other at {v} km/h and {u} km/h. When do they meet, and how far has each gone?
{name} can paint a fence in {a:2..8} hours, and {name2} can paint it in {b:3..10} hours. How long does it take if they work together? {tail}
If you invest ${p:500..20000} at {r:2..9}% interest compounded annually, how much will you have after {n:2..15} years, and how much of it is interest?
Find the mean, median and mode of these numbers: {a:1..20}, {b:1..20}, {a}, {c:1..30}, {d:1..30}, {e:1..40}, {f:1..40}. {tail}
Compute {a:1..9}/{b:3..12} {plus|minus|times|divided by} {c:1..9}/{d:2..12} and write the result as a simplified fraction. {tail}
{_g:2..12}{_a:2..15}{_b:2..15}Find the greatest common divisor and the least common multiple of {=a*g} and {=b*g}. {tail}
{_a:2..13}{_b:2..13}{_c:2..13}What is the prime factorization of {=a*b*c}? {tail}
Find the derivative of f(x) = {a:2..9}x^{n:3..6} + {b:2..9}x^2 - {c:1..20}x + {e:1..50}, and evaluate f'({x:1..4}).
Evaluate the definite integral of {a:1..9}x^2 + {b:1..9}x from 0 to {c:1..5}. {tail}
{_c:4..15}{name} is {k:2..5} times as old as {name2}. In {n:2..12} years, the sum of their ages will be {=k*c+c+2*n}. How old is each of them now? {tail}
How many liters of a {p:5..25}% acid solution must be mixed with {v:2..20} liters of a {q:50..80}% solution to get a {r:30..45}% solution? {tail}
How many different {k:2..5}-person committees can be formed from {n:8..20} people? What if one particular person must be included?
{_u:10..200}{_a:1..5}{_b:1..5}{_c:1..6}${=u*(a+b+c)} is shared among {name}, {name2} and {name3} in the ratio {a}:{b}:{c}. How much does each get? {tail}
A town's population grew from {a:2000..9000} to {b:9001..20000} in {n:3..10} years. What was the percentage increase, and the average yearly growth rate?
A clock shows {h:1..12}:{05|10|15|20|25|35|40|45|50}. What is the smaller angle between the hour and minute hands? {tail}
{name} drives {a:60..300} km at {v:50..110} km/h and then {b:40..200} km at {u:40..90} km/h. What is the average speed for the whole trip? {tail}
[coding]
Write a {plang} function that {ctask}. {Include a few test cases.|Aim for O(n) time.|Comment the tricky parts.|Handle empty input.|}
What is the time and space complexity of {quicksort|merge sort|binary search|Dijkstra's algorithm|heap sort|breadth-first search}? Walk through a small example. {follow}
Find the bug in this code and explain how to fix it: {bug}
Explain what this code does and when you would use it: {const unique = [...new Set(items)];|print(sorted(set(w.lower() for w in text.split())))|git log --oneline --graph --all}
Write a SQL query that {finds the top earner per department in employees(name, department, salary)|lists the 5 biggest spenders of 2023 in orders(customer_id, total, created_at)}. Explain how an index could make it faster. {follow}
What is the difference between {processes and threads|the stack and the heap|TCP and UDP|git merge and git rebase|a shallow and a deep copy}? Show a short example in {plang}.
Implement {a stack|a queue built from two stacks|an LRU cache|a binary search tree|a min-heap|a trie} in {plang}, with the usual operations and a short usage example.
Write a regular expression that matches {US phone numbers|dates like 2024-03-15|hex color codes|IPv4 addresses}, and explain each part. {follow}
Write a Bash script that {renames every .jpeg file in a folder to .jpg|finds the 10 largest files in a directory tree|deletes logs older than 30 days}. Make it safe to run twice. {follow}
How would you design {a URL shortener|a chat app for a million users|a rate limiter for an API|a parking reservation system}? Describe the components, data model and scaling. {follow}
My program fails with {an IndexError in Python|a NullPointerException in Java|a segmentation fault in C++|a Rust borrow checker error}. What usually causes this, and how do I debug it? {follow}
Write unit tests with {pytest|Jest|JUnit|Go's testing package} for a function that {ctask}. Cover normal and edge cases.
Write a {plang} program that reads a CSV file of {sales records|student grades|temperature readings} and prints {the total per group|the top three rows|the average and standard deviation}.
Write a REST endpoint in {Flask|FastAPI|Express|Django|Spring Boot} that {returns a paginated list of products|creates a user after validating the input|deletes a comment only if the requester wrote it}. {follow}
Show how {quicksort|merge sort|insertion sort|selection sort|heap sort} works step by step on the array [{a:1..99}, {b:1..99}, {c:1..99}, {d:1..99}, {e:1..99}, {f:1..99}].
Write HTML and CSS for {a responsive navigation bar|a pricing table with three plans|a login form with error messages|a dark-mode toggle}. Keep it accessible. {follow}
Compare {plang} and {plang2} for {a web backend|a command-line tool|data analysis|game development|embedded systems}. When would you choose each?
Which git commands would I use to {undo my last commit but keep the changes|squash my last few commits|recover a deleted branch}? Explain each one. {follow}
Write a {plang} class for {a bank account with deposit and withdraw methods|a to-do list with priorities|a shopping cart that computes tax}. Include input validation.
Solve this in {plang} and explain your approach: {leet}.
I'm preparing for a coding interview. Give me a hint, but not the full solution, for this problem: {leet}. {follow}
My {plang} script takes {t:10..90} seconds to process {n:10..500} thousand rows. What are common ways to speed it up?
Explain {cstopic} to a junior developer, with a small {plang} example.
Translate this Python function to {JavaScript|Go|Rust|Java|C++}: {def clamp(x, lo, hi): return max(lo, min(x, hi))|def evens(xs): return [x for x in xs if x % 2 == 0]}
Write a small command-line to-do app in {plang} that stores tasks in a JSON file, with add, list and done commands. {follow}
[extraction]
Here is a customer review: "I bought the {brand} {gadget} for ${p:30..400} in {month}. {revgood} However, {revbad}. I'd rate it {r:1..5} out of 5." Extract the product, price, rating, main pro and main con {xformat}.
Is this review positive, negative or mixed? Quote the key phrase. "The {brand} {gadget} arrived after {d:2..14} days. {revgood} Sadly, {revbad}."
{city}, {month} {day:1..28}: {company} announced on {weekday} that it will {action}, creating {j:50..900} jobs. CEO {name} {surname} said it will cost ${m:5..900} million and finish by {y:2025..2032}. Extract the company, CEO, cost, jobs and deadline {xformat}.
Summarize this news item in one sentence, then list every number in it and what it refers to: "{company} said on {weekday} that it plans to {action}. Profit fell {p:3..40}% last year. About {j:100..5000} staff in {city} will be affected."
Notes from {weekday}'s meeting: {name} will {mtask} by {month} {day:1..28}; {name2} will {mtask2} by {weekday2}; a budget of ${b:2..90},000 was approved. List every action item with its owner and deadline {xformat}.
Turn these meeting notes into a short follow-up email to the team: "{name} to {mtask} by {weekday}. {name2} to {mtask2}. Open question: {the timeline|vendor pricing|staff workload}. Next meeting: {month} {day:1..28}."
Dear {name}, your flight {AB|KL|TX|QF}{f:100..999} from {city} to {city2} leaves on {month} {day:1..28} at {h:5..22}:{00|15|30|45} from gate {g:1..40}. Baggage allowance: {kg:15..32} kg. Extract the flight number, route, date, time, gate and allowance {xformat}.
Here is a table. Player, Team, Goals, Assists; {name}, {team}, {g1:0..25}, {a1:0..15}; {name2}, {team2}, {g2:0..25}, {a2:0..15}; {name3}, {team}, {g3:0..25}, {a3:0..15}. Which team scored more goals, and who has the most assists? Answer {xformat}.
Convert this order into a markdown table with a total row: {fruit} {w1:2..40} kg at ${p1:1..9}/kg, {fruit2} {w2:2..40} kg at ${p2:1..9}/kg, {fruit3} {w3:2..40} kg at ${p3:1..9}/kg.
{name} {surname} was born in {city} in {y:1950..1995}. After studying {field} in {city2}, they founded {company} in {z:1996..2020}, which now employs {n:10..900} people. Extract all people, places, organizations and years {xformat}.
Make a timeline, one line per event, from this biography: "{name} {surname} grew up in {city}, moved to {city2} at {a:16..30} to study {field}, won a national award in {y:1990..2015} and retired in {z:2016..2024}."
To make {k:4..12} pancakes, mix {f:1..3} cups of flour, {e:1..3} eggs, {m:1..2} cups of milk and a pinch of salt, and cook each for {t:1..3} minutes per side. List the ingredients with quantities {xformat}, then scale them for {=k*2} pancakes.
Tag each customer comment with a topic (price, quality, delivery or support) and a sentiment, {xformat}: 1) "{comment}" 2) "{comment2}" 3) "{comment3}"
{company} is hiring a {job} in {city}: ${s:40..160},000 a year, {v:15..30} days of vacation, at least {y:1..8} years of experience, fluent {tongue} required, applications close {month} {day:1..28}. Extract the role, location, salary, vacation, requirements and deadline {xformat}.
Forecast for {city}: {weekday}, sunny, high of {t1:10..35}°C; {weekday2}, rain, high of {t2:5..30}°C; {weekday3}, windy, gusts up to {w:30..90} km/h. Which day is best for a picnic? Then give the data {xformat}.
Invoice #{i:1000..9999} from {company} to {name} {surname}: {q1:1..9} x {item} at ${p1:3..90}, {q2:1..9} x {item2} at ${p2:3..90}, shipping ${s:5..25}, due {month} {day:1..28}. Extract the line items and the total due, {xformat}.
Researchers in {city} reported that {coffee is linked to better morning focus|short walks after meals lower blood sugar|music lessons improve memory in children}, in a study of {n:50..5000} people published in {month} {y:2018..2024}. Lead author Dr. {surname} urged caution. Extract the finding, sample size, date and lead author {xformat}.
Who in this text works for which company, and who traveled where? Answer {xformat}: "{name} flew from {city} to {city2} to meet {name2} {surname}, a manager at {company}. They later visited {company2}'s office in {city3}."
Pull out all dates, times and amounts of money from this message, in order: "Hi {name}, the ${d:100..900} deposit is due on {month} {day:1..28}. Check-in is at {h:2..5} pm on {weekday}, and the remaining ${r:200..3000} is due on arrival."
Three apartments: A) {a1:1..3} bedrooms, ${p1:900..2500}/month, {m1:2..25} min from downtown; B) {a2:1..4} bedrooms, ${p2:900..2500}/month, {m2:2..25} min; C) {a3:1..4} bedrooms, ${p3:900..2500}/month, {m3:2..25} min. Put them in a table and say which is cheapest per bedroom.
Extract the key facts from this listing {xformat}: "{brand} {gadget}, model {X|Z|Q}{n:100..990}. Weight: {g:150..3000} g. Warranty: {w:1..5} years. Price: ${p:20..600}. Colors: {color} or {color2}."
From this support ticket, extract the customer name, order number, problem and requested action {xformat}: "Hi, this is {name} {surname}. Order #{o:10000..99999} arrived on {weekday}, but {revbad}. I'd like a {refund|replacement}."
Rewrite these notes as a clean bulleted list of facts, then say which one matters most: "{company} Q{q:1..4}: revenue ${r:10..99}M, up {u:2..30}%; new office in {city}; CEO {name} {surname} steps down in {month}."
Parse this into a JSON object with the fields origin, destination, distance_km, hours and stops: "{name} and {name2} drove {k:50..900} km from {city} to {city2} in {h:4..12} hours, stopping {s:2..5} times."
Scores: {name} {s1:40..100}, {name2} {s2:40..100}, {name3} {s3:40..100}, {name4} {s4:40..100}, {name5} {s5:40..100}. Return the students who scored above {c:60..85}, sorted by score, {xformat}.
[stem]
Explain {stemtopic} {to a ten-year-old|to a first-year university student|in simple terms|for a science fair poster|with an everyday analogy}. {cons}
What is the difference between {mitosis and meiosis|weather and climate|speed and velocity|a virus and a bacterium|mass and weight|heat and temperature}? {cons}
Why does {the sky look blue|ice float on water|bread rise in the oven|a spoon look bent in water|metal feel colder than wood|an airplane stay up}? Give an everyday example. {follow}
How does {a refrigerator|a microwave oven|a touchscreen|a nuclear reactor|a heat pump|a 3D printer|an MRI machine|a jet engine} work? Explain it step by step for a beginner. {follow}
A car with a mass of {m:800..2000} kg accelerates from rest to {v:10..35} m/s in {t:4..15} s. What is the average net force, and how much work is done?
Write the balanced equation for {the combustion of methane|sodium reacting with water|the rusting of iron|the decomposition of hydrogen peroxide}, and explain what happens to the atoms and to the energy. {follow}
What would happen if {the Moon were twice as close|all insects disappeared|Earth had no magnetic field|gravity were 10% stronger|Earth's axis had no tilt}? Reason it through scientifically. {follow}
Describe the role of {the liver|red blood cells|insulin|the hippocampus|the kidneys|mitochondria|the gut microbiome} in the human body, and what happens when it fails. {follow}
Design a simple experiment to test whether {plants grow faster with music|salt water freezes more slowly|caffeine affects typing speed}. Name the independent, dependent and controlled variables. {follow}
Compare {energy} and {energy2} in terms of cost, emissions and reliability. Use a table.
What were the most important contributions of {Marie Curie|Isaac Newton|Rosalind Franklin|Alan Turing|Charles Darwin|Dmitri Mendeleev|Lise Meitner}, and why do they still matter? {cons}
An object is dropped from a height of {h:5..200} m. How long does it take to land, and how fast is it going? Ignore air resistance.
What is the pH of a 0.{c:1..9} M solution of {hydrochloric|nitric|acetic} acid? Explain the steps and any assumptions.
What is the wavelength of light with a frequency of {f:4..7}.{g:0..9} x 10^14 Hz, and what color is it?
Explain {cstopic} using an analogy from {cooking|sports|music|gardening|traffic}.
Summarize what scientists know about {dark matter|the origin of life|consciousness|why we sleep|the expansion of the universe}, and what is still uncertain. {cons}
What are the main stages of {mitosis|the life cycle of a star like the Sun|hurricane formation|digestion|the rock cycle}? Describe each in one or two sentences. {follow}
A {v:3..24} V battery drives two resistors of {a:2..50} and {b:2..50} ohms in {series|parallel}. Find the total current and the power used by each resistor.
Why is {lithium|silicon|helium|copper|uranium|titanium} so important in modern industry? Give {k:2..5} examples of its uses.
What are the main ethical concerns about {facial recognition|gene editing in embryos|self-driving cars|brain-computer interfaces}? Discuss two risks and two benefits. {follow}
Write a short lesson plan for teaching {stemtopic} to {5th-grade|8th-grade|high school} students, including one hands-on activity.
Give {k:3..6} real-world applications of {stemtopic}, with one sentence on each.
Is it true that {we only use 10% of our brains|lightning never strikes twice in the same place|bats are blind|goldfish have a three-second memory}? Explain what the evidence shows. {follow}
How much energy is needed to heat {m:1..20} kg of water from {a:5..30}°C to {b:40..100}°C? The specific heat of water is 4186 J/(kg K).
I'm a {job} with no science background. Explain {stemtopic} in a way that relates to my work.
[humanities]
Write an essay of about {w:300..800} words on {humtopic}. {cons}
What were the main causes of {histevent}? {cons}
Compare how {phil} and {phil2} thought about {philq}.
Explain why {work} is still widely read today, and discuss {k:2..4} of its main themes. {follow}
How did {histevent} change {daily life|the role of women|trade|art and literature|religion|education}?
Summarize the main ideas of {Stoicism|Existentialism|Impressionism|Romanticism|Utilitarianism|Surrealism|Confucianism} and name {k:2..5} key figures.
Discuss whether {art should be judged separately from the artist|museums should return artifacts to their countries of origin|history is written by the victors}. Present both sides first. {follow}
Explain {opportunity cost|inflation|the tragedy of the commons|comparative advantage|confirmation bias|the social contract|moral hazard} with an example from everyday life. {cons}
What lessons does {histevent} offer about {leadership in a crisis|inequality|new technology|public health}?
Describe a day in the life of an ordinary person in {ancient Egypt|Tang dynasty China|medieval England|Victorian London|Edo-period Japan|1920s Paris}. {cons}
How does the main character of {work} change by the end, and why does it matter? {follow}
How did {art} reflect the values and worries of its time? {follow}
Write a short biography of {histfig} focusing on {their early life|their biggest failure|their lasting influence|their rivals}. {cons}
What are the strongest arguments for and against {a universal basic income|a higher minimum wage|free university tuition|a carbon tax|a wealth tax}? Use a table, then conclude. {follow}
Explain the origins and traditions of {Diwali|the Day of the Dead|Lunar New Year|Thanksgiving|Nowruz|Hanukkah|Holi}, and how it is celebrated today. {follow}
Compare the political systems of {country} and {country2}, focusing on how leaders are chosen and how laws are made.
Create a timeline of {histevent} with {k:5..10} key dates and one sentence for each.
How would {phil} respond to {social media addiction|climate change|AI replacing jobs|fast fashion}? Base your answer on their known ideas.
What does the proverb "{The early bird catches the worm|Still waters run deep|Too many cooks spoil the broth|Fall seven times, stand up eight}" mean? Describe a modern situation where it applies. {follow}
Recommend {k:3..6} books for someone who wants to understand {humtopic}, with one sentence on why each is useful.
Design a {k:4..10}-week course outline on {humtopic} for {audience}, with a title and a reading for each week.
Why is {Machu Picchu|Angkor Wat|the Acropolis|Great Zimbabwe|the Forbidden City|Timbuktu|Petra} historically important? What does it tell us about the society that built it? {follow}
Analyze {the trolley problem|lying to protect a friend|whistleblowing on your employer} from a utilitarian and a Kantian perspective. Which view is more convincing? {follow}
Was {histevent} inevitable? Argue your position in {k:3..5} paragraphs. {follow}
Write a museum placard of under {w:60..120} words that explains {art} to visitors.
"""


def parse_lists(text):
    lists, key = {}, None
    for line in text.strip().splitlines():
        key, line = (key, line.strip()[1:]) if line.startswith(" ") else line.split(": ", 1)
        lists.setdefault(key, []).extend(entry.strip() for entry in line.split("|"))
    return lists


def fill(text, rng, env, used):
    """Expand the slots of ``text``: {list} draws from LISTS and {list2} draws a different entry of the same list,
    {a|b|c} picks one option, {v:lo..hi} draws an integer ({_v:lo..hi} draws it without printing it) and {=expr}
    prints arithmetic on earlier integers. A slot named twice prints the same value both times."""
    def slot(match):
        body = match[1]
        if "|" in body:
            return fill(rng.choice(body.split("|")), rng, env, used)
        if body.startswith("="):
            return str(eval(body[1:], {"__builtins__": {}}, env))
        if number := NUMBER.fullmatch(body):
            env[number[2]] = rng.randint(int(number[3]), int(number[4]))
            return "" if number[1] else str(env[number[2]])
        if body not in env:
            taken = used.setdefault(key := body.rstrip("0123456789"), set())
            pick = rng.choice([entry for entry in LISTS[key] if entry not in taken])
            taken.add(pick)
            env[body] = fill(pick, rng, env, used)
        return str(env[body])
    return SLOT.sub(slot, text)


def prompt(category, rng):
    text = fill(rng.choice(TEMPLATES[category]), rng, {}, {})
    if category in CHATTY and rng.random() < 0.15:
        text = rng.choice(LISTS["opener"]) + " " + text
    return re.sub(r"\b([Aa]) (?=8|11\b|18\b)", r"\1n ", " ".join(text.split()))


def main():
    rng, seen, columns = random.Random(0), set(), []
    for category in TEMPLATES:
        column, tries = [], 0
        while len(column) < PER_CATEGORY and tries < 100 * PER_CATEGORY:
            text, tries = prompt(category, rng), tries + 1
            if 8 <= len(text) <= 400 and text not in seen:
                seen.add(text)
                column.append(text)
        columns.append(column)
        print(f"{category}: {len(column)}")
    assert {len(column) for column in columns} == {PER_CATEGORY}
    OUT.write_text("".join(text + "\n" for row in zip(*columns) for text in row), encoding="utf-8")
    print(f"{PER_CATEGORY * len(columns)} prompts -> {OUT}")


LISTS = parse_lists(LISTS)
SECTIONS = re.split(r"^\[(\w+)\]$", TEMPLATES.strip(), flags=re.M)
TEMPLATES = {name: block.strip().splitlines() for name, block in zip(SECTIONS[1::2], SECTIONS[2::2])}

if __name__ == "__main__":
    main()
