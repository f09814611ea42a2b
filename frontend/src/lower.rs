//! Syntax tree → `ir::Model`: resolves names (including values of enclosing graphs used by
//! subgraphs), checks attribute kinds, builds typed ops and constant tensors, and copies spans
//! into the graph.
//!
//! Every problem becomes a [`Diagnostic`] pointing at the text; lowering goes on after an
//! error where it can, so one run reports several problems.

use std::collections::{HashMap, HashSet};

use ir::tensor::Storage;
use ir::{AttrKind, AttrValue, Attribute, Graph, Model, Op, Output, Span, Tensor, TensorData, Type, Value};

use crate::ast::{self, Data, LiteralKind, Single, Spanned};
use crate::diag::Diagnostic;

/// String attributes with this prefix are compiler annotations (see `ir::Node::annotations`).
const ANNOTATION_PREFIX: &str = "shardc_";

/// The result of lowering: the model and any warnings.
pub struct Lowered {
    /// The model.
    pub model: Model,
    /// Things accepted but worth saying (such as ops kept opaque).
    pub warnings: Vec<Diagnostic>,
}

/// Lowers a parsed file.
pub fn lower(m: &ast::Model) -> Result<Lowered, Vec<Diagnostic>> {
    lower_with(m, Vec::new())
}

/// Lowers a syntax tree whose tensors may refer to decoded `values` ([`Data::Decoded`]), as
/// the binary reader builds it; each value is moved into the tensor that refers to it.
pub fn lower_with(m: &ast::Model, values: Vec<TensorData>) -> Result<Lowered, Vec<Diagnostic>> {
    let decoded = values.into_iter().map(Some).collect();
    let mut cx = Lowerer { errors: Vec::new(), warnings: Vec::new(), opset: 0, decoded };
    let mut model = Model {
        ir_version: 0,
        opset_import: Vec::new(),
        producer_name: None,
        producer_version: None,
        domain: None,
        model_version: None,
        doc_string: None,
        metadata_props: None,
        graph: Graph::new(""),
        functions: Vec::new(),
    };
    if let Some(items) = &m.header {
        cx.model_header(items, &mut model);
    }
    cx.opset = model.default_opset().unwrap_or(0);
    let (graph, captured) = cx.graph(&m.graph, &[]);
    debug_assert!(captured.is_empty(), "the main graph has no enclosing scope");
    model.graph = graph;
    for f in &m.functions {
        if let Some(func) = cx.function(f) {
            model.functions.push(func);
        }
    }
    if cx.errors.is_empty() { Ok(Lowered { model, warnings: cx.warnings }) } else { Err(cx.errors) }
}

struct Lowerer {
    errors: Vec<Diagnostic>,
    warnings: Vec<Diagnostic>,
    opset: i64,
    /// Decoded tensor values not yet taken ([`Data::Decoded`]).
    decoded: Vec<Option<TensorData>>,
}

/// Names a graph defines, for resolving references from its subgraphs.
type Scope = HashSet<String>;

fn parse_int(lit: &ast::Literal) -> Result<i64, Diagnostic> {
    match &lit.node {
        LiteralKind::Int(s) => s.parse().map_err(|_| {
            Diagnostic::error("integer out of range").with_primary(lit.span, "does not fit in a 64-bit integer")
        }),
        LiteralKind::Float(_) => {
            Err(Diagnostic::error("expected an integer, found a float").with_primary(lit.span, "not an integer"))
        }
        LiteralKind::Str(_) => {
            Err(Diagnostic::error("expected an integer, found a string").with_primary(lit.span, "not an integer"))
        }
    }
}

fn parse_float(text: &str) -> f64 {
    let lower = text.to_ascii_lowercase();
    let (neg, body) = match lower.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, lower.as_str()),
    };
    let v = match body {
        "inf" | "infinity" => f64::INFINITY,
        "nan" => f64::NAN,
        _ => body.parse::<f64>().unwrap_or(f64::NAN),
    };
    if neg { -v } else { v }
}

fn parse_f32(lit: &ast::Literal) -> Result<f32, Diagnostic> {
    match &lit.node {
        LiteralKind::Int(s) | LiteralKind::Float(s) => {
            let lower = s.to_ascii_lowercase();
            let body = lower.trim_start_matches('-');
            let v = match body {
                "inf" | "infinity" => f32::INFINITY,
                "nan" => f32::NAN,
                // Parse straight to f32: correctly rounded, like strtof.
                _ => body
                    .parse::<f32>()
                    .map_err(|_| Diagnostic::error("invalid number").with_primary(lit.span, "not a float literal"))?,
            };
            Ok(if lower.starts_with('-') { -v } else { v })
        }
        LiteralKind::Str(_) => {
            Err(Diagnostic::error("expected a number, found a string").with_primary(lit.span, "not a number"))
        }
    }
}

fn parse_f64(lit: &ast::Literal) -> Result<f64, Diagnostic> {
    match &lit.node {
        LiteralKind::Int(s) | LiteralKind::Float(s) => Ok(parse_float(s)),
        LiteralKind::Str(_) => {
            Err(Diagnostic::error("expected a number, found a string").with_primary(lit.span, "not a number"))
        }
    }
}

fn parse_string(lit: &ast::Literal) -> Result<String, Diagnostic> {
    match &lit.node {
        LiteralKind::Str(s) => Ok(s.clone()),
        _ => Err(Diagnostic::error("expected a string").with_primary(lit.span, "not a string")),
    }
}

/// Edit distance, for "did you mean".
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

fn suggest<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> Option<String> {
    let limit = (name.chars().count() / 3).clamp(1, 3);
    candidates
        .filter(|c| !c.is_empty())
        .map(|c| (distance(name, c), c))
        .filter(|(d, _)| *d <= limit)
        .min()
        .map(|(_, c)| c.to_string())
}

impl Lowerer {
    fn err(&mut self, d: Diagnostic) {
        self.errors.push(d);
    }

    fn model_header(&mut self, items: &[ast::HeaderItem], model: &mut Model) {
        for item in items {
            let key = item.key.node.as_str();
            let res: Result<(), Diagnostic> = (|| {
                match (key, &item.value) {
                    ("ir_version", ast::HeaderValue::Literal(l)) => model.ir_version = parse_int(l)?,
                    ("model_version", ast::HeaderValue::Literal(l)) => model.model_version = Some(parse_int(l)?),
                    ("producer_name", ast::HeaderValue::Literal(l)) => model.producer_name = Some(parse_string(l)?),
                    ("producer_version", ast::HeaderValue::Literal(l)) => {
                        model.producer_version = Some(parse_string(l)?)
                    }
                    ("domain", ast::HeaderValue::Literal(l)) => model.domain = Some(parse_string(l)?),
                    ("doc_string", ast::HeaderValue::Literal(l)) => model.doc_string = Some(parse_string(l)?),
                    ("opset_import", ast::HeaderValue::Pairs(pairs, _)) => {
                        for (d, v) in pairs {
                            model.opset_import.push((d.node.clone(), parse_int(v)?));
                        }
                    }
                    ("metadata_props", ast::HeaderValue::Pairs(pairs, _)) => {
                        let mut props = Vec::new();
                        for (k, v) in pairs {
                            props.push((k.node.clone(), parse_string(v)?));
                        }
                        model.metadata_props = Some(props);
                    }
                    (
                        "ir_version" | "model_version" | "producer_name" | "producer_version" | "domain" | "doc_string"
                        | "opset_import" | "metadata_props",
                        _,
                    ) => {
                        let want = match key {
                            "opset_import" => "a list like `[\"\" : 17]`",
                            "metadata_props" => "a list like `[\"key\": \"value\"]`",
                            "ir_version" | "model_version" => "an integer",
                            _ => "a string",
                        };
                        return Err(Diagnostic::error(format!("header entry `{key}` needs {want}"))
                            .with_primary(item.span, "wrong kind of value"));
                    }
                    _ => {
                        return Err(Diagnostic::error(format!("unknown header entry `{key}`"))
                            .with_primary(item.key.span, "not a model header keyword")
                            .with_note(
                                "expected one of ir_version, opset_import, producer_name, producer_version, \
                                 domain, model_version, doc_string, metadata_props",
                            ));
                    }
                }
                Ok(())
            })();
            if let Err(d) = res {
                self.err(d);
            }
        }
    }

    /// Builds a constant tensor from a type and data.
    fn tensor(&mut self, ty: &ast::TypeAst, data: &Data, name: Option<String>) -> Option<Tensor> {
        let Type::Tensor(tt) = &ty.ty else {
            self.err(
                Diagnostic::error("tensor data needs a tensor type")
                    .with_primary(ty.span, format!("`{}` is not a tensor type", ty.ty)),
            );
            return None;
        };
        let Some(dims) = tt.dims.as_ref().and_then(|d| d.iter().map(|x| x.value()).collect::<Option<Vec<i64>>>())
        else {
            self.err(
                Diagnostic::error("tensor data needs a type with numeric dimensions")
                    .with_primary(ty.span, format!("`{tt}` has unknown or symbolic dimensions"))
                    .with_note("write the shape as numbers, e.g. `float[2,3] w = {…}`"),
            );
            return None;
        };
        let dtype = tt.dtype;
        let tdata = match data {
            Data::External(entries, span) => {
                // As ONNX's checker: external data lies beside the model or below it.
                for (_, loc) in entries.iter().filter(|(k, _)| k == "location") {
                    let p = std::path::Path::new(loc);
                    // (A root, a drive prefix or `..` is a component other than a name.)
                    let outside = loc.is_empty()
                        || loc.starts_with('\\')
                        || p.components()
                            .any(|c| !matches!(c, std::path::Component::Normal(_) | std::path::Component::CurDir));
                    if outside {
                        self.err(
                            Diagnostic::error(format!("external data location `{loc}` is not a file beside the model"))
                                .with_primary(*span, "this tensor's data")
                                .with_note(
                                    "`location` is a relative path inside the model's directory (no `..`, no absolute path)",
                                ),
                        );
                        return None;
                    }
                }
                TensorData::External(entries.clone())
            }
            Data::Decoded(i, span) => match self.decoded.get_mut(*i).and_then(Option::take) {
                Some(d) => d,
                None => {
                    self.err(Diagnostic::error("tensor data used twice").with_primary(*span, "already used"));
                    return None;
                }
            },
            Data::Inline(lits, span) => {
                let Some(storage) = Storage::of(dtype) else {
                    self.err(
                        Diagnostic::error(format!("inline data of type {dtype} cannot be written in the text syntax"))
                            .with_primary(*span, "unsupported element type"),
                    );
                    return None;
                };
                let res: Result<TensorData, Diagnostic> = (|| {
                    Ok(match storage {
                        Storage::Int32 => TensorData::Int32(
                            lits.iter()
                                .map(|l| {
                                    let v = parse_int(l)?;
                                    i32::try_from(v).map_err(|_| {
                                        Diagnostic::error(format!("value out of range for {dtype}"))
                                            .with_primary(l.span, "does not fit in 32 bits")
                                    })
                                })
                                .collect::<Result<_, _>>()?,
                        ),
                        Storage::Int64 => TensorData::Int64(lits.iter().map(parse_int).collect::<Result<_, _>>()?),
                        Storage::Uint64 => TensorData::Uint64(
                            lits.iter()
                                .map(|l| match &l.node {
                                    LiteralKind::Int(s) => s.parse::<u64>().map_err(|_| {
                                        Diagnostic::error(format!("value out of range for {dtype}"))
                                            .with_primary(l.span, "not an unsigned 64-bit integer")
                                    }),
                                    _ => parse_int(l).map(|v| v as u64),
                                })
                                .collect::<Result<_, _>>()?,
                        ),
                        Storage::Float => TensorData::Float(lits.iter().map(parse_f32).collect::<Result<_, _>>()?),
                        Storage::Double => TensorData::Double(lits.iter().map(parse_f64).collect::<Result<_, _>>()?),
                        Storage::Strings => {
                            TensorData::Strings(lits.iter().map(parse_string).collect::<Result<_, _>>()?)
                        }
                    })
                })();
                match res {
                    Ok(d) => d,
                    Err(d) => {
                        self.err(d);
                        return None;
                    }
                }
            }
        };
        let t = Tensor { dtype, dims, name, data: tdata };
        if let (Some(len), Data::Inline(_, span) | Data::Decoded(_, span)) = (t.stored_len(), data) {
            let want = t.numel() * t.values_per_element();
            if len as u64 != want {
                self.err(
                    Diagnostic::error(format!("{} needs {want} value(s), found {len}", t.tensor_type()))
                        .with_primary(*span, format!("{len} value(s) here"))
                        .with_secondary(ty.span, "the shape asks for this many"),
                );
                return None;
            }
        }
        Some(t)
    }

    fn attr_kind(&mut self, kind: &Spanned<String>) -> Option<AttrKind> {
        let k = AttrKind::from_name(&kind.node);
        if k.is_none() {
            self.err(
                Diagnostic::error(format!("unknown attribute kind `{}`", kind.node))
                    .with_primary(kind.span, "not an attribute kind")
                    .with_note(
                        "expected int, float, string, tensor, graph, type_proto, or a list kind (ints, floats, …)",
                    ),
            );
        }
        k
    }

    /// Lowers one value of an attribute; `expected` is the singleton kind asked for.
    fn single_value(
        &mut self,
        v: &Single,
        expected: Option<AttrKind>,
        scopes: &[&Scope],
        captured: &mut Vec<String>,
    ) -> Option<AttrValue> {
        let value = match v {
            Single::Literal(l) => match &l.node {
                LiteralKind::Int(_) if expected == Some(AttrKind::Float) => match parse_f32(l) {
                    Ok(f) => AttrValue::Float(f),
                    Err(d) => return self.fail(d),
                },
                LiteralKind::Int(_) => match parse_int(l) {
                    Ok(i) => AttrValue::Int(i),
                    Err(d) => return self.fail(d),
                },
                LiteralKind::Float(_) => match parse_f32(l) {
                    Ok(f) => AttrValue::Float(f),
                    Err(d) => return self.fail(d),
                },
                LiteralKind::Str(s) => AttrValue::String(s.clone()),
            },
            Single::Tensor { ty, name, data, .. } => AttrValue::Tensor(self.tensor(ty, data, name.clone())?),
            Single::Type(t) => AttrValue::TypeProto(t.ty.clone()),
            Single::Graph(g) => {
                let (sub, caps) = self.graph(g, scopes);
                for c in caps {
                    if !captured.contains(&c) {
                        captured.push(c);
                    }
                }
                AttrValue::Graph(Box::new(sub))
            }
            Single::Ref(r) => match expected {
                Some(k) => AttrValue::Ref(k, r.node.clone()),
                None => {
                    return self.fail(
                        Diagnostic::error(format!("the reference `@{}` needs a kind annotation", r.node))
                            .with_primary(r.span, "kind unknown")
                            .with_note("write e.g. `alpha: float = @alpha`"),
                    );
                }
            },
        };
        if let Some(k) = expected
            && value.kind() != k
            && !matches!(value, AttrValue::Ref(..))
        {
            return self.fail(
                Diagnostic::error(format!("attribute value is a `{}`, but the annotation says `{k}`", value.kind()))
                    .with_primary(v.span(), format!("a `{}` value", value.kind())),
            );
        }
        Some(value)
    }

    fn fail<T>(&mut self, d: Diagnostic) -> Option<T> {
        self.err(d);
        None
    }

    fn attribute(&mut self, a: &ast::Attr, scopes: &[&Scope], captured: &mut Vec<String>) -> Option<Attribute> {
        let kind = match &a.kind {
            Some(k) => Some(self.attr_kind(k)?),
            None => None,
        };
        let value = match &a.value {
            ast::AttrValue::Single(v) => {
                if let Some(k) = kind
                    && k.element().is_some()
                {
                    return self.fail(
                        Diagnostic::error(format!(
                            "attribute `{}` is declared `{k}` but has a single value",
                            a.name.node
                        ))
                        .with_primary(v.span(), "write a list: `[…]`"),
                    );
                }
                self.single_value(v, kind, scopes, captured)?
            }
            ast::AttrValue::List(items, span) => {
                let elem = match kind {
                    Some(k) => match k.element() {
                        Some(e) => Some(e),
                        None => {
                            return self.fail(
                                Diagnostic::error(format!(
                                    "attribute `{}` is declared `{k}` but has a list value",
                                    a.name.node
                                ))
                                .with_primary(*span, "a list"),
                            );
                        }
                    },
                    None => None,
                };
                if items.is_empty() {
                    return match kind {
                        Some(AttrKind::Ints) => Some(Attribute::new(a.name.node.clone(), AttrValue::Ints(vec![]))),
                        Some(AttrKind::Floats) => Some(Attribute::new(a.name.node.clone(), AttrValue::Floats(vec![]))),
                        Some(AttrKind::Strings) => {
                            Some(Attribute::new(a.name.node.clone(), AttrValue::Strings(vec![])))
                        }
                        Some(AttrKind::Tensors) => {
                            Some(Attribute::new(a.name.node.clone(), AttrValue::Tensors(vec![])))
                        }
                        Some(AttrKind::Graphs) => Some(Attribute::new(a.name.node.clone(), AttrValue::Graphs(vec![]))),
                        Some(AttrKind::TypeProtos) => {
                            Some(Attribute::new(a.name.node.clone(), AttrValue::TypeProtos(vec![])))
                        }
                        _ => self.fail(
                            Diagnostic::error(format!("the empty list of `{}` needs a kind annotation", a.name.node))
                                .with_primary(*span, "kind unknown")
                                .with_note(format!("write e.g. `{}: ints = []`", a.name.node)),
                        ),
                    };
                }
                // Without an annotation a list of numbers is floats if any element is a float.
                let elem = elem.or_else(|| {
                    let any_float = items
                        .iter()
                        .any(|i| matches!(i, Single::Literal(l) if matches!(l.node, LiteralKind::Float(_))));
                    any_float.then_some(AttrKind::Float)
                });
                let mut values = Vec::new();
                for it in items {
                    values.push(self.single_value(it, elem, scopes, captured)?);
                }
                let first = values[0].kind();
                if let Some(bad) = values.iter().position(|v| v.kind() != first) {
                    return self.fail(
                        Diagnostic::error("the elements of an attribute list must all be of one kind")
                            .with_primary(items[bad].span(), format!("a `{}`", values[bad].kind()))
                            .with_secondary(items[0].span(), format!("a `{first}`")),
                    );
                }
                macro_rules! collect {
                    ($var:ident, $list:ident) => {
                        AttrValue::$list(
                            values
                                .into_iter()
                                .map(|v| if let AttrValue::$var(x) = v { x } else { unreachable!() })
                                .collect(),
                        )
                    };
                }
                match first {
                    AttrKind::Int => collect!(Int, Ints),
                    AttrKind::Float => collect!(Float, Floats),
                    AttrKind::String => collect!(String, Strings),
                    AttrKind::Tensor => collect!(Tensor, Tensors),
                    AttrKind::Graph => AttrValue::Graphs(
                        values
                            .into_iter()
                            .map(|v| if let AttrValue::Graph(g) = v { *g } else { unreachable!() })
                            .collect(),
                    ),
                    AttrKind::TypeProto => collect!(TypeProto, TypeProtos),
                    _ => {
                        return self.fail(
                            Diagnostic::error("references cannot be list elements")
                                .with_primary(*span, "use a reference of a list kind instead"),
                        );
                    }
                }
            }
        };
        Some(Attribute::new(a.name.node.clone(), value))
    }

    /// Lowers a graph. `scopes` are the names of the enclosing graphs, innermost last.
    /// Returns the graph and the names it reads from enclosing graphs.
    fn graph(&mut self, g: &ast::Graph, scopes: &[&Scope]) -> (Graph, Vec<String>) {
        let mut graph = Graph::new(g.name.node.clone());
        graph.opset = self.opset;
        let mut defined: HashMap<String, Span, foldhash::fast::RandomState> = HashMap::default();
        let mut captured: Vec<String> = Vec::new();
        // Names whose definition was rejected (an error was reported): uses of them are not
        // reported again.
        let mut failed: std::collections::HashSet<String> = std::collections::HashSet::new();

        // Every name this graph defines, so its subgraphs can tell outer references apart.
        let mut scope: Scope = HashSet::new();
        for e in g.inputs.iter().chain(g.inits.iter().filter(|e| e.data.is_some())) {
            scope.insert(e.info.name.node.clone());
        }
        for n in &g.nodes {
            for o in n.outputs.iter().flatten().filter(|o| !o.node.is_empty()) {
                scope.insert(o.node.clone());
            }
        }

        let mut define = |cx: &mut Lowerer, name: &Spanned<String>| -> bool {
            if let Some(prev) = defined.get(&name.node) {
                cx.err(
                    Diagnostic::error(format!("`{}` is defined more than once", name.node))
                        .with_primary(name.span, "defined again here")
                        .with_secondary(*prev, "first defined here"),
                );
                false
            } else {
                defined.insert(name.node.clone(), name.span);
                true
            }
        };

        for e in &g.inputs {
            if !define(self, &e.info.name) {
                continue;
            }
            let ty = e.info.ty.as_ref().map(|t| t.ty.clone());
            let v = graph.add_input(e.info.name.node.clone(), ty);
            graph.set_span(v.node, e.span);
            if let Some(data) = &e.data {
                match &e.info.ty {
                    Some(t) => {
                        if let Some(tensor) = self.tensor(t, data, None) {
                            graph.set_input_default(v, tensor);
                        }
                    }
                    None => self.err(
                        Diagnostic::error(format!("the default value of input `{}` needs a type", e.info.name.node))
                            .with_primary(e.info.name.span, "no type written"),
                    ),
                }
            }
        }

        let mut value_infos: Vec<&ast::ValueInfo> = Vec::new();
        for e in &g.inits {
            let Some(data) = &e.data else {
                value_infos.push(&e.info);
                continue;
            };
            let Some(t) = &e.info.ty else {
                failed.insert(e.info.name.node.clone());
                self.err(
                    Diagnostic::error(format!("initializer `{}` needs a type", e.info.name.node))
                        .with_primary(e.info.name.span, "no type written")
                        .with_note("write e.g. `float[2] w = {1, 2}`"),
                );
                continue;
            };
            // An initializer named like an input is that input's default value.
            if let Some(v) = graph.lookup(&e.info.name.node)
                && matches!(graph.node(v.node).op, Op::Input { default: None })
            {
                if let Some(tensor) = self.tensor(t, data, None) {
                    graph.set_input_default(v, tensor);
                }
                continue;
            }
            if !define(self, &e.info.name) {
                continue;
            }
            match self.tensor(t, data, None) {
                Some(tensor) => {
                    let v = graph.add_initializer(e.info.name.node.clone(), tensor);
                    graph.set_span(v.node, e.span);
                }
                None => {
                    failed.insert(e.info.name.node.clone());
                }
            }
        }

        // Pass 1: create the nodes with their outputs and ops.
        let mut inner_scopes: Vec<&Scope> = scopes.to_vec();
        inner_scopes.push(&scope);
        let mut created = Vec::new();
        for n in &g.nodes {
            let mut outputs = Vec::new();
            for o in &n.outputs {
                match o {
                    // `""` is an omitted optional output, as an omitted one is.
                    Some(name) if !name.node.is_empty() => {
                        define(self, name);
                        outputs.push(Output::named(name.node.clone()));
                    }
                    _ => outputs.push(Output::named("")),
                }
            }
            let mut node_caps = Vec::new();
            let (op, annotations) = self.node_op(n, &inner_scopes, &mut node_caps);
            let id = graph.add_labeled_node(n.label.as_ref().map(|l| l.node.clone()), op, vec![], outputs);
            for (k, v) in annotations {
                graph.set_annotation(id, k, v);
            }
            let written: Vec<String> =
                n.attrs.iter().map(|a| a.name.node.clone()).filter(|a| !a.starts_with(ANNOTATION_PREFIX)).collect();
            if !written.is_sorted() {
                graph.set_attr_order(id, written);
            }
            graph.set_span(id, n.span);
            created.push((id, n, node_caps));
        }

        // Pass 2: resolve inputs and captures.
        let resolve = |cx: &mut Lowerer, graph: &mut Graph, captured: &mut Vec<String>, name: &Spanned<String>| {
            if let Some(v) = graph.lookup(&name.node) {
                return Some(v);
            }
            if failed.contains(&name.node) {
                return None;
            }
            if scopes.iter().any(|s| s.contains(&name.node)) {
                let v = graph.add_outer_ref(name.node.clone(), None);
                captured.push(name.node.clone());
                return Some(v);
            }
            let mut d = Diagnostic::error(format!("undefined value `{}`", name.node))
                .with_primary(name.span, "not defined in this graph");
            let hint = suggest(&name.node, scope.iter().map(String::as_str).filter(|c| *c != name.node));
            if let Some(h) = hint {
                d = d.with_note(format!("did you mean `{h}`?"));
            }
            cx.err(d);
            None
        };
        for (id, n, caps) in created {
            let mut inputs = Vec::with_capacity(n.inputs.len());
            for i in &n.inputs {
                inputs.push(match i {
                    Some(name) if name.node.is_empty() => None,
                    Some(name) => resolve(self, &mut graph, &mut captured, name),
                    None => None,
                });
            }
            graph.set_inputs(id, inputs);
            if !caps.is_empty() {
                let values: Vec<Value> = caps
                    .iter()
                    .filter_map(|c| {
                        resolve(self, &mut graph, &mut captured, &Spanned { node: c.clone(), span: n.span })
                    })
                    .collect();
                graph.set_captures(id, values);
            }
        }

        for vi in value_infos {
            let ty = vi.ty.as_ref().map(|t| t.ty.clone());
            graph.note_value_info(vi.name.node.clone());
            match graph.lookup(&vi.name.node) {
                Some(v) if !matches!(graph.node(v.node).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef) => {
                    graph.set_type(v, ty)
                }
                _ => graph.set_extra_value_info(vi.name.node.clone(), ty),
            }
        }

        let mut outputs = Vec::new();
        for o in &g.outputs {
            if let Some(v) = resolve(self, &mut graph, &mut captured, &o.name) {
                outputs.push(ir::GraphOutput { value: v, ty: o.ty.as_ref().map(|t| t.ty.clone()) });
            }
        }
        graph.set_outputs(outputs);
        (graph, captured)
    }

    /// The op of a node, and its compiler annotations (string attributes named `shardc_*`).
    fn node_op(&mut self, n: &ast::Node, scopes: &[&Scope], captured: &mut Vec<String>) -> (Op, Vec<(String, String)>) {
        let mut attrs = Vec::new();
        let mut annotations = Vec::new();
        let mut seen: HashMap<&str, Span> = HashMap::new();
        for a in &n.attrs {
            if let Some(prev) = seen.insert(a.name.node.as_str(), a.name.span) {
                self.err(
                    Diagnostic::error(format!("attribute `{}` is given twice", a.name.node))
                        .with_primary(a.name.span, "given again here")
                        .with_secondary(prev, "first given here"),
                );
                continue;
            }
            if let Some(attr) = self.attribute(a, scopes, captured) {
                match attr.value {
                    AttrValue::String(v) if attr.name.starts_with(ANNOTATION_PREFIX) => {
                        annotations.push((attr.name, v))
                    }
                    _ => attrs.push(attr),
                }
            }
        }
        (self.node_op_from(n, attrs), annotations)
    }

    fn node_op_from(&mut self, n: &ast::Node, attrs: Vec<Attribute>) -> Op {
        let opaque = |attrs: Vec<Attribute>| {
            Op::Opaque(ir::Opaque {
                domain: n.domain.clone(),
                op_type: n.op_type.node.clone(),
                overload: n.overload.clone().unwrap_or_default(),
                attrs,
            })
        };
        if n.overload.is_some() {
            return opaque(attrs);
        }
        match Op::from_parts(&n.domain, &n.op_type.node, attrs.clone()) {
            Ok(op) => op,
            Err(ir::op::OpError::WrongKind { op, attribute, expected, found }) => {
                let span = n.attrs.iter().find(|a| a.name.node == attribute).map_or(n.span, |a| a.span);
                self.err(
                    Diagnostic::error(format!(
                        "attribute `{attribute}` of {op} must be of kind `{expected}`, found `{found}`"
                    ))
                    .with_primary(span, format!("expected `{expected}`")),
                );
                opaque(attrs)
            }
            Err(ir::op::OpError::UnknownAttribute { op, attribute }) => {
                let span = n.attrs.iter().find(|a| a.name.node == attribute).map_or(n.span, |a| a.name.span);
                let known = Op::known_attributes(&n.domain, &n.op_type.node).unwrap_or(&[]);
                let mut d = Diagnostic::warning(format!(
                    "{op} has no attribute `{attribute}` in the opsets shardc knows; the node is kept as an opaque op"
                ))
                .with_primary(span, "unknown attribute");
                if let Some(h) = suggest(&attribute, known.iter().copied()) {
                    d = d.with_note(format!("did you mean `{h}`?"));
                }
                self.warnings.push(d);
                opaque(attrs)
            }
        }
    }

    fn function(&mut self, f: &ast::Function) -> Option<Function> {
        let mut func = Function {
            domain: String::new(),
            overload: String::new(),
            opset_import: Vec::new(),
            doc_string: None,
            attr_params: f.attr_params.iter().map(|a| a.node.clone()).collect(),
            attr_defaults: Vec::new(),
            body: Graph::new(f.name.node.clone()),
        };
        for item in f.header.iter().flatten() {
            let res: Result<(), Diagnostic> = (|| {
                match (item.key.node.as_str(), &item.value) {
                    ("domain", ast::HeaderValue::Literal(l)) => func.domain = parse_string(l)?,
                    ("overload", ast::HeaderValue::Literal(l)) => func.overload = parse_string(l)?,
                    ("doc_string", ast::HeaderValue::Literal(l)) => func.doc_string = Some(parse_string(l)?),
                    ("opset_import", ast::HeaderValue::Pairs(pairs, _)) => {
                        for (d, v) in pairs {
                            func.opset_import.push((d.node.clone(), parse_int(v)?));
                        }
                    }
                    (k, _) => {
                        return Err(Diagnostic::error(format!("unknown function header entry `{k}`"))
                            .with_primary(item.key.span, "expected domain, overload, opset_import or doc_string"));
                    }
                }
                Ok(())
            })();
            if let Err(d) = res {
                self.err(d);
            }
        }
        let mut caps = Vec::new();
        for a in &f.attr_defaults {
            if let Some(attr) = self.attribute(a, &[], &mut caps) {
                func.attr_defaults.push(attr);
            }
        }
        // The body: formal inputs become graph inputs, then the nodes as in any graph.
        let as_entries: Vec<ast::Entry> =
            f.inputs.iter().map(|vi| ast::Entry { info: vi.clone(), data: None, span: vi.name.span }).collect();
        let vis: Vec<ast::Entry> =
            f.value_infos.iter().map(|vi| ast::Entry { info: vi.clone(), data: None, span: vi.name.span }).collect();
        let g = ast::Graph {
            name: f.name.clone(),
            inputs: as_entries,
            outputs: f.outputs.clone(),
            inits: vis,
            nodes: f.nodes.clone(),
            span: f.span,
        };
        let (body, captured) = self.graph(&g, &[]);
        debug_assert!(captured.is_empty());
        func.body = body;
        Some(func)
    }
}

use ir::Function;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance() {
        assert_eq!(distance("kitten", "sitting"), 3);
        assert_eq!(suggest("relu_out", ["relu_0ut", "conv"].into_iter()), Some("relu_0ut".into()));
        assert_eq!(suggest("x", ["conv"].into_iter()), None);
    }
}
