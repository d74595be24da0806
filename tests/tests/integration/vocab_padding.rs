//! A vocabulary padded to a multiple (`model.make_vocab_size_divisible_by`, Note [Padded
//! vocabulary] in `model/src/vocab_padding.rs`): Hugging Face weights of the tokenizer's
//! vocabulary (the parity fixture's 97 tokens, safetensors and PyTorch `.bin`) load into a
//! model of 104 rows with zero padding rows, padded weights load as they are, weights without
//! a vocabulary leave it as initialised; the padding rows are softmax classes that train (the
//! loss and the output bias's gradient computed here from the logits on the host); files of
//! another vocabulary are refused naming the sizes the model takes, or the setting.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{Int, Tensor, TensorData};
use ember_model::{BertConfig, BertForPreTraining, WeightsFile, padded_vocab_size};
use safetensors::SafeTensors;

type B = Autodiff<NdArray>;

/// The parity fixture's vocabulary, and the model's rows padded to a multiple of 8.
const V: usize = 97;
const PADDED: usize = 104;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

fn config() -> BertConfig {
    let config = BertConfig::load_json(&fixture("hf_tiny_bert").join("config.json")).unwrap();
    assert_eq!(config.vocab_size, V);
    config
}

fn padded_model() -> BertForPreTraining<B> {
    let mut config = config();
    config.vocab_size = padded_vocab_size(V, 8);
    assert_eq!(config.vocab_size, PADDED);
    config.init_for_pretraining(&Default::default())
}

/// Every tensor of a safetensors file as f32 values: name → (shape, values).
fn tensors(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

fn write(path: &Path, tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>) {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, (shape, values))| {
            let data = values.iter().flat_map(|x| x.to_le_bytes()).collect();
            (name.clone(), shape.clone(), data)
        })
        .collect();
    let views = bytes.iter().map(|(name, shape, data)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data);
        (name.clone(), view.unwrap())
    });
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn saved(model: &BertForPreTraining<B>, dir: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let path = dir.join("saved.safetensors");
    model.save_hf_safetensors(&path).unwrap();
    tensors(&path)
}

/// The fixture's tensors, with the two vocabulary tensors padded by zero rows.
fn expect_padded(
    saved: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    original: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) {
    assert_eq!(saved.len(), original.len());
    for (name, (shape, values)) in original {
        let (saved_shape, saved_values) = &saved[name];
        if shape[0] != V || !(name.contains("word_embeddings") || name == "cls.predictions.bias") {
            assert!(saved[name] == original[name], "{name} changed");
            continue;
        }
        let row = values.len() / V;
        assert_eq!(saved_shape[0], PADDED, "{name}");
        assert_eq!(saved_shape[1..], shape[1..], "{name}");
        assert_eq!(
            saved_values[..V * row],
            values[..],
            "{name}: the vocabulary's rows"
        );
        assert!(
            saved_values[V * row..].iter().all(|&x| x == 0.0),
            "{name}: the padding rows are not zero"
        );
    }
}

#[test]
fn weights_of_the_tokenizers_vocabulary_load_into_a_padded_model_with_zero_rows() {
    let dir = tempfile::tempdir().unwrap();
    let original = tensors(&fixture("hf_tiny_bert").join("model.safetensors"));
    for source in ["hf_tiny_bert", "hf_tiny_bert_bin"] {
        let file = WeightsFile::find(&fixture(source)).unwrap();
        let (model, report) = padded_model().load_pretrained_padded(&file, V).unwrap();
        assert!(
            report.initialised.is_empty(),
            "{source}: {:?}",
            report.initialised
        );
        assert_eq!(report.loaded.len(), 46, "{source}");
        assert_eq!(model.vocab_size(), PADDED);
        let embeddings = &model.bert.embeddings.word_embeddings.weight;
        assert!(embeddings.val().is_require_grad(), "{source}: still trains");
        assert!(model.cls.predictions.bias.val().is_require_grad());
        expect_padded(&saved(&model, dir.path()), &original);
    }

    // A file of the padded size (an ember checkpoint of a padded run: its padding rows drawn,
    // not zero) loads as it is, into a model whose padding rows were zero.
    let padded_file = dir.path().join("padded.safetensors");
    let drawn = padded_model();
    drawn.save_hf_safetensors(&padded_file).unwrap();
    let drawn = tensors(&padded_file);
    let drawn_rows = |t: &BTreeMap<String, (Vec<usize>, Vec<f32>)>| {
        t["bert.embeddings.word_embeddings.weight"].1[V * 32..].to_vec()
    };
    assert!(drawn_rows(&drawn).iter().any(|&x| x != 0.0));
    let zeroed = padded_model().with_vocab_rows(V).with_vocab_rows(PADDED);
    assert!(
        drawn_rows(&saved(&zeroed, dir.path()))
            .iter()
            .all(|&x| x == 0.0)
    );
    let (again, report) = zeroed
        .load_pretrained_padded(&WeightsFile::Safetensors(padded_file.clone()), V)
        .unwrap();
    assert!(report.initialised.is_empty());
    assert!(saved(&again, dir.path()) == drawn);

    // In a file that fits the padded vocabulary, a tensor of another shape is refused as
    // load_pretrained refuses it, with no word about the vocabulary.
    let misshaped_file = dir.path().join("misshaped.safetensors");
    let mut misshaped = drawn.clone();
    let dense = misshaped
        .get_mut("cls.predictions.transform.dense.bias")
        .unwrap();
    *dense = (vec![31], dense.1[..31].to_vec());
    write(&misshaped_file, &misshaped);
    let e = padded_model()
        .load_pretrained_padded(&WeightsFile::Safetensors(misshaped_file), V)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cls.predictions.transform.dense.bias") && !e.contains("make_vocab"),
        "{e}"
    );

    // A file without the vocabulary's tensors (an encoder from elsewhere) leaves them as
    // initialised, at the padded size, and lists them.
    let partial_file = dir.path().join("partial.safetensors");
    let mut partial = original.clone();
    partial.remove("bert.embeddings.word_embeddings.weight");
    partial.remove("cls.predictions.bias");
    partial.remove("cls.predictions.decoder.bias");
    write(&partial_file, &partial);
    let (model, report) = padded_model()
        .load_pretrained_padded(&WeightsFile::Safetensors(partial_file), V)
        .unwrap();
    let mut initialised = report.initialised.clone();
    initialised.sort();
    assert_eq!(
        initialised,
        [
            "bert.embeddings.word_embeddings.weight",
            "cls.predictions.bias"
        ]
    );
    assert_eq!(model.vocab_size(), PADDED);
    // The padding rows stay as drawn.
    assert!(
        drawn_rows(&saved(&model, dir.path()))
            .iter()
            .any(|&x| x != 0.0)
    );

    let file = WeightsFile::find(&fixture("hf_tiny_bert")).unwrap();
    // An unpadded model loads the fixture as load_pretrained does.
    let unpadded: BertForPreTraining<B> = config().init_for_pretraining(&Default::default());
    let (unpadded, _) = unpadded.load_pretrained_padded(&file, V).unwrap();
    assert!(saved(&unpadded, dir.path()) == original);
}

#[test]
fn weights_of_another_vocabulary_are_refused_naming_both_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let file = WeightsFile::find(&fixture("hf_tiny_bert")).unwrap();
    // The fixture is a vocabulary of 97: a model whose tokenizer has 90 pads to 96 and takes
    // neither 97 rows nor any other size.
    let mut config = config();
    config.vocab_size = padded_vocab_size(90, 8);
    let model: BertForPreTraining<B> = config.init_for_pretraining(&Default::default());
    let e = model
        .load_pretrained_padded(&file, 90)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.safetensors")
            && e.contains("[97, 32]")
            && e.contains("[96, 32]")
            && e.contains("90 tokens padded to 96")
            && e.contains("not 97")
            && e.contains("model.make_vocab_size_divisible_by"),
        "{e}"
    );
    // A padded run's weights (104 rows) given to an unpadded model of the 97 tokens: the
    // error names the setting that would take them.
    let padded_file = dir.path().join("padded.safetensors");
    padded_model().save_hf_safetensors(&padded_file).unwrap();
    let unpadded: BertForPreTraining<B> = self::config().init_for_pretraining(&Default::default());
    let e = unpadded
        .load_pretrained_padded(&WeightsFile::Safetensors(padded_file), V)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[104, 32]")
            && e.contains("104 rows, more than the tokenizer's 97")
            && e.contains("if these are the weights of a run whose vocabulary was padded")
            && e.contains("model.make_vocab_size_divisible_by"),
        "{e}"
    );
}

/// Ids of every parameter, in module order.
fn param_ids(model: &BertForPreTraining<B>) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl ModuleVisitor<B> for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    model.visit(&mut ids);
    ids.0
}

/// The padding rows are classes of the masked-LM softmax (NVIDIA's loss is over all of the
/// padded vocabulary's logits): a model padded with zero rows gives the unpadded logits in
/// its first `V` columns and 0 in the others, its MLM loss is the cross-entropy over all
/// `PADDED` logits, and its output bias's gradient at a padding class is the mean of that
/// class's probability, nonzero: the decoder trains those rows.
#[test]
fn the_padding_rows_are_softmax_classes_that_train() {
    let device = Default::default();
    let file = WeightsFile::find(&fixture("hf_tiny_bert")).unwrap();
    let unpadded: BertForPreTraining<B> = config().init_for_pretraining(&device);
    let (unpadded, _) = unpadded.load_pretrained(&file).unwrap();
    let padded = unpadded.clone().with_vocab_rows(PADDED);
    assert_eq!(param_ids(&padded), param_ids(&unpadded), "ids kept");

    // Two samples of 12, the second padded after 9; five masked positions over both.
    let ids: Vec<i64> = (0..24).map(|i| 5 + (i * 7) % (V as i64 - 5)).collect();
    let mut input_ids = ids.clone();
    let mut mask = vec![1i64; 24];
    for i in 21..24 {
        input_ids[i] = 0;
        mask[i] = 0;
    }
    let int2 = |v: Vec<i64>| Tensor::<B, 2, Int>::from_data(TensorData::new(v, [2, 12]), &device);
    let int1 = |v: Vec<i64>| {
        let n = v.len();
        Tensor::<B, 1, Int>::from_data(TensorData::new(v, [n]), &device)
    };
    let segments: Vec<i64> = (0..24).map(|i| i64::from(i % 12 >= 6)).collect();
    let positions = int1(vec![1, 3, 7, 12 + 2, 12 + 8]);
    let labels = vec![10i64, 20, 30, 40, 96];
    let forward = |model: &BertForPreTraining<B>| {
        let out = model.forward(
            int2(input_ids.clone()),
            int2(segments.clone()),
            int2(mask.clone()),
            positions.clone(),
        );
        let loss = model.loss(&out, int1(labels.clone()), int1(vec![0, 1]));
        (out, loss)
    };
    let values = |t: Tensor<B, 2>| t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
    let scalar = |t: Tensor<B, 1>| f64::from(t.into_data().to_vec::<f32>().unwrap()[0]);

    let (out, _) = forward(&unpadded);
    let base = values(out.mlm_logits);
    let (out, loss) = forward(&padded);
    assert_eq!(out.mlm_logits.dims(), [5, PADDED]);
    let logits = values(out.mlm_logits.clone());
    let mut expected_loss = 0.0f64;
    let mut expected_grad = [0.0f64; PADDED - V];
    for (n, &label) in labels.iter().enumerate() {
        let row = &logits[n * PADDED..(n + 1) * PADDED];
        for (v, (&x, &y)) in row[..V].iter().zip(&base[n * V..(n + 1) * V]).enumerate() {
            assert!((x - y).abs() < 1e-5, "row {n}, class {v}: {x} vs {y}");
        }
        assert!(
            row[V..].iter().all(|&x| x == 0.0),
            "padding logits of row {n}"
        );
        let row: Vec<f64> = row.iter().map(|&x| f64::from(x)).collect();
        let max = row.iter().copied().fold(f64::MIN, f64::max);
        let sum: f64 = row.iter().map(|x| (x - max).exp()).sum();
        expected_loss += max + sum.ln() - row[label as usize];
        for (k, g) in expected_grad.iter_mut().enumerate() {
            *g += (row[V + k] - max).exp() / sum;
        }
    }
    expected_loss /= labels.len() as f64;
    let mlm = scalar(loss.mlm.clone());
    assert!(
        (mlm - expected_loss).abs() < 1e-5,
        "MLM loss {mlm}, the cross-entropy over all {PADDED} logits {expected_loss}"
    );
    // Not the unpadded model's loss: the padding classes hold probability.
    let (_, unpadded_loss) = forward(&unpadded);
    assert!(mlm - scalar(unpadded_loss.mlm) > 1e-3);

    let grads = loss.total.backward();
    let bias_grad = padded
        .cls
        .predictions
        .bias
        .grad(&grads)
        .expect("the output bias has a gradient")
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(bias_grad.len(), PADDED);
    // The tied decoder trains the padding rows of the word embeddings too.
    let table_grad = padded
        .bert
        .embeddings
        .word_embeddings
        .weight
        .grad(&grads)
        .expect("the word embeddings have a gradient")
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let hidden = table_grad.len() / PADDED;
    for row in V..PADDED {
        let norm: f32 = table_grad[row * hidden..(row + 1) * hidden]
            .iter()
            .map(|g| g * g)
            .sum();
        assert!(norm > 0.0, "padding row {row} has no gradient");
    }
    for (k, expected) in expected_grad.iter().enumerate() {
        let expected = expected / labels.len() as f64;
        let got = f64::from(bias_grad[V + k]);
        assert!(
            expected > 1e-4 && (got - expected).abs() < 1e-6,
            "padding class {}: bias gradient {got}, expected {expected}",
            V + k
        );
    }
}
