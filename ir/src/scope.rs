//! Where a node came from in the exporter's module tree.
//!
//! Exporters leave the framework's module path in the names they write: torch's TorchScript
//! exporter in node names (`/layer1/layer1.0/conv1/Conv`, `/bert/encoder/layer.0/attention/
//! self/query/MatMul`), the dynamo exporter and most others only in parameter names
//! (`transformer.h.0.attn.c_attn.weight`). Reports group ops by these paths, and by the
//! repeated block they belong to (`layer1.0`, `transformer.h.0`), so that a user reads a plan
//! in terms of the layers they wrote.

use std::collections::HashMap;

use crate::{Graph, NodeId, Op};

/// The annotation naming the module(s) of the model a node was exported from, when the
/// exporter said so in the node's metadata (torch's dynamo exporter: `pkg.torch.onnx.
/// name_scopes` and `pkg.torch.onnx.class_hierarchy`) or a rewrite joined several nodes
/// (a fused GEMM of `q_proj`, `k_proj` and `v_proj`): `path: class` entries (the class when
/// known) separated by `, `, e.g. `model.layers.0.mlp.up_proj: torch.nn.modules.linear.Linear`.
pub const MODULE: &str = "shardc_module";

/// A module of the model as written: its dotted path and, when the exporter said, its class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleRef {
    /// `model.layers.0.self_attn.q_proj`.
    pub path: String,
    /// `torch.nn.modules.linear.Linear`, when known.
    pub class: Option<String>,
}

/// The [`MODULE`] annotation's value for torch's node metadata: the innermost module of
/// `name_scopes` (a Python list literal whose last entry is the node's own name, e.g.
/// `['', 'm', 'm.model', 'm.model.embed_tokens', 'embedding']`) with its class from
/// `class_hierarchy` (the list of the same length). `None` at the root module.
pub fn torch_module_annotation(name_scopes: &str, class_hierarchy: Option<&str>) -> Option<String> {
    let scopes = python_str_list(name_scopes)?;
    let path = scopes.len().checked_sub(2).map(|i| scopes[i].clone()).filter(|p| !p.is_empty())?;
    let class =
        class_hierarchy.and_then(python_str_list).filter(|c| c.len() == scopes.len()).map(|c| c[c.len() - 2].clone());
    Some(format_modules(&[ModuleRef { path, class }]))
}

/// `['a', 'b.c']` → `["a", "b.c"]`; `None` when the text is not such a list.
fn python_str_list(s: &str) -> Option<Vec<String>> {
    let inner = s.trim().strip_prefix('[')?.strip_suffix(']')?.trim();
    if inner.is_empty() {
        return Some(Vec::new());
    }
    inner
        .split(", ")
        .map(|e| {
            let e = e.trim();
            e.strip_prefix('\'')
                .and_then(|e| e.strip_suffix('\''))
                .or_else(|| e.strip_prefix('"').and_then(|e| e.strip_suffix('"')))
                .map(str::to_string)
        })
        .collect()
}

/// The [`MODULE`] annotation's text for `modules`.
pub fn format_modules(modules: &[ModuleRef]) -> String {
    let entries: Vec<String> = modules
        .iter()
        .map(|m| match &m.class {
            Some(c) => format!("{}: {c}", m.path),
            None => m.path.clone(),
        })
        .collect();
    entries.join(", ")
}

/// The modules the [`MODULE`] annotation of node `n` names (empty without one).
pub fn modules(g: &Graph, n: NodeId) -> Vec<ModuleRef> {
    let Some((_, text)) = g.node(n).annotations.iter().find(|(k, _)| k == MODULE) else { return Vec::new() };
    text.split(", ")
        .filter(|e| !e.is_empty())
        .map(|e| match e.split_once(": ") {
            Some((p, c)) => ModuleRef { path: p.to_string(), class: Some(c.to_string()) },
            None => ModuleRef { path: e.to_string(), class: None },
        })
        .collect()
}

/// The modules of node `n` as a rewrite that joins it with others should record them: its
/// [`MODULE`] annotation's, else its own module path ([`own_module_path`]) without a class.
pub fn modules_or_path(g: &Graph, n: NodeId) -> Vec<ModuleRef> {
    let m = modules(g, n);
    if !m.is_empty() {
        return m;
    }
    own_module_path(g, n).map(|path| vec![ModuleRef { path, class: None }]).unwrap_or_default()
}

/// The longest common dotted prefix of `paths` (`a.b.c`, `a.b.d` → `a.b`).
fn common_path(paths: &[&str]) -> String {
    let Some(first) = paths.first() else { return String::new() };
    let mut common: Vec<&str> = first.split('.').collect();
    for p in &paths[1..] {
        let n = common.iter().zip(p.split('.')).take_while(|(a, b)| *a == b).count();
        common.truncate(n);
    }
    common.join(".")
}

/// The dotted module path of a node: from its [`MODULE`] annotation when it has one (the
/// modules' common path when a rewrite joined several), else from its name when the exporter wrote one
/// (`/layer1/layer1.0/conv1/Conv` → `layer1.0.conv1`), else from the first parameter it reads
/// (`transformer.h.0.attn.c_attn.weight` → `transformer.h.0.attn.c_attn`). `None` when
/// neither says.
pub fn own_module_path(g: &Graph, n: NodeId) -> Option<String> {
    own_path_among(g, n, &|_| true)
}

/// [`own_module_path`] counting only the readers `among` admits when it asks whether a
/// parameter is shared (a training graph's backward ops and updates read every parameter
/// again).
fn own_path_among(g: &Graph, n: NodeId, among: &dyn Fn(NodeId) -> bool) -> Option<String> {
    let node = g.node(n);
    let named = modules(g, n);
    if !named.is_empty() {
        let paths: Vec<&str> = named.iter().map(|m| m.path.as_str()).collect();
        let p = common_path(&paths);
        if !p.is_empty() {
            return Some(p);
        }
    }
    if let Some(p) = node.label.as_deref().and_then(path_of_scoped_name) {
        return Some(p);
    }
    for v in node.inputs().iter().flatten() {
        // A parameter read by several ops (an exporter that stored equal tensors once, tied
        // embeddings) does not say which module an op belongs to.
        let shared = || {
            let mut readers: Vec<NodeId> = g.users(*v).into_iter().map(|(u, _)| u).filter(|&u| among(u)).collect();
            readers.sort();
            readers.dedup();
            readers.len() > 1
        };
        if matches!(g.node(v.node).op, Op::Initializer(_) | Op::Input { default: Some(_) })
            && crate::cost::is_param(g, *v)
            && !shared()
            && let Some(p) = parameter_module(g.value_name(*v))
        {
            return Some(p);
        }
    }
    None
}

/// The module path of every computing node of `order`: its own ([`own_module_path`]), else
/// that of the latest (in `order`) input producer that has one, else that of the node before
/// it in `order` (the residual adds, activations and reshapes between two layers belong to
/// the layer that produced their newest input: `x + attn(x)` to the attention, not to
/// whichever layer began the residual stream). Nodes before any named one get `""`.
pub fn module_paths(g: &Graph, order: &[NodeId]) -> HashMap<NodeId, String> {
    module_paths_with(g, order, &|_| true)
}

/// [`module_paths`] of the ops of `order` alone: a parameter is shared when two of them read
/// it (a training graph's forward ops, with its backward pass and updates left out).
pub fn module_paths_among(g: &Graph, order: &[NodeId]) -> HashMap<NodeId, String> {
    let ops: std::collections::HashSet<NodeId> = order.iter().copied().collect();
    module_paths_with(g, order, &|n| ops.contains(&n))
}

fn module_paths_with(g: &Graph, order: &[NodeId], among: &dyn Fn(NodeId) -> bool) -> HashMap<NodeId, String> {
    let mut out: HashMap<NodeId, String> = HashMap::new();
    let at: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let mut previous = String::new();
    for &n in order {
        let p = own_path_among(g, n, among).or_else(|| {
            g.node(n)
                .inputs()
                .iter()
                .flatten()
                .filter(|v| out.get(&v.node).is_some_and(|p| !p.is_empty()))
                .max_by_key(|v| at.get(&v.node).copied().unwrap_or(0))
                .and_then(|v| out.get(&v.node).cloned())
        });
        let p = p.unwrap_or_else(|| previous.clone());
        previous = p.clone();
        out.insert(n, p);
    }
    out
}

/// The repeated block a module path lies in: the path up to its first numeric component
/// (`transformer.h.0.attn.c_attn` → `transformer.h.0`, `layer1.0.conv1` → `layer1.0`), else
/// its first component (`conv1`, `lm_head`); `""` stays `""`.
pub fn block_of(path: &str) -> String {
    let parts: Vec<&str> = path.split('.').collect();
    match parts.iter().position(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())) {
        Some(i) => parts[..=i].join("."),
        None => parts[0].to_string(),
    }
}

/// `/a/a.0/b/Op` → `a.0.b`: the scope components joined with dots, where a component that
/// repeats its parent's path as a prefix (`layer1` then `layer1.0`) replaces it. `None` when
/// the name has no scope (`node_Gemm_12`, `Conv_3`).
fn path_of_scoped_name(name: &str) -> Option<String> {
    let name = name.strip_prefix('/')?;
    let mut comps: Vec<&str> = name.split('/').collect();
    comps.pop(); // the op's own name
    let mut path = String::new();
    for c in comps.into_iter().filter(|c| !c.is_empty()) {
        let last = path.rsplit('.').next().unwrap_or("");
        if !last.is_empty() && c.strip_prefix(last).is_some_and(|r| r.starts_with('.')) {
            // `/layer1/layer1.0`: the child names itself after its parent; it replaces it.
            path.truncate(path.len() - last.len());
            path.push_str(c);
        } else {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(c);
        }
    }
    (!path.is_empty()).then_some(path)
}

/// The module whose parameter a value name is: `transformer.h.0.attn.c_attn.weight` →
/// `transformer.h.0.attn.c_attn`; a leading `m.` or `model.` wrapper the exporter added stays
/// (it is what the user's module tree says). `None` for names without a dotted path
/// (`onnx::Conv_193`, `W1`, `val_12`: constants an exporter folded or named itself).
pub fn parameter_module(name: &str) -> Option<String> {
    if name.contains("::") || !name.contains('.') {
        return None;
    }
    let (path, _leaf) = name.rsplit_once('.')?;
    (!path.is_empty() && path.split('.').all(|c| !c.is_empty() && !c.contains(char::is_whitespace)))
        .then(|| path.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scoped_names_give_dotted_paths() {
        assert_eq!(path_of_scoped_name("/layer1/layer1.0/conv1/Conv").as_deref(), Some("layer1.0.conv1"));
        assert_eq!(
            path_of_scoped_name("/bert/encoder/layer.0/attention/self/query/MatMul").as_deref(),
            Some("bert.encoder.layer.0.attention.self.query")
        );
        assert_eq!(path_of_scoped_name("/conv1/Conv").as_deref(), Some("conv1"));
        assert_eq!(path_of_scoped_name("/Add").as_deref(), None);
        assert_eq!(path_of_scoped_name("node_Gemm_1332"), None);
    }

    #[test]
    fn parameters_give_their_module() {
        assert_eq!(
            parameter_module("m.transformer.h.0.attn.c_attn.weight").as_deref(),
            Some("m.transformer.h.0.attn.c_attn")
        );
        assert_eq!(parameter_module("fc.bias").as_deref(), Some("fc"));
        assert_eq!(parameter_module("onnx::Conv_193"), None);
        assert_eq!(parameter_module("W1"), None);
    }

    #[test]
    fn torch_metadata_names_the_innermost_module() {
        let scopes = "['', 'm', 'm.model', 'm.model.layers.0.mlp', 'm.model.layers.0.mlp.up_proj', 'linear_5']";
        let classes = "['__main__.Logits', 'a.LlamaForCausalLM', 'a.LlamaModel', 'a.LlamaMLP', 'torch.nn.modules.linear.Linear', 'aten.linear.default']";
        assert_eq!(
            torch_module_annotation(scopes, Some(classes)).as_deref(),
            Some("m.model.layers.0.mlp.up_proj: torch.nn.modules.linear.Linear")
        );
        assert_eq!(torch_module_annotation(scopes, None).as_deref(), Some("m.model.layers.0.mlp.up_proj"));
        assert_eq!(torch_module_annotation("['', 'add']", Some("['M', 'aten.add']")), None);
        assert_eq!(torch_module_annotation("not a list", None), None);
        assert_eq!(common_path(&["a.b.q", "a.b.k", "a.b.v"]), "a.b");
        assert_eq!(common_path(&["a.b"]), "a.b");
    }

    #[test]
    fn blocks_stop_at_the_first_index() {
        assert_eq!(block_of("transformer.h.0.attn.c_attn"), "transformer.h.0");
        assert_eq!(block_of("m.transformer.h.11.mlp"), "m.transformer.h.11");
        assert_eq!(block_of("layer1.0.conv1"), "layer1.0");
        assert_eq!(block_of("bert.encoder.layer.3.attention.self.query"), "bert.encoder.layer.3");
        assert_eq!(block_of("lm_head"), "lm_head");
        assert_eq!(block_of(""), "");
    }
}
