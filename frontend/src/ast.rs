//! The syntax tree: what the text says, with a span on everything a diagnostic may point at.
//! Names are not resolved and attribute kinds are not checked here; `lower` does that.

use ir::{Span, Type};

/// A string with the span it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Spanned<T> {
    /// The value.
    pub node: T,
    /// Where it was written.
    pub span: Span,
}

/// A literal number or string.
#[derive(Clone, Debug, PartialEq)]
pub enum LiteralKind {
    /// An integer, as written (parsed later, for the width its context needs).
    Int(String),
    /// A float, as written (including `nan`, `-inf`, `Infinity`).
    Float(String),
    /// A string, unescaped.
    Str(String),
}

/// A literal with its span.
pub type Literal = Spanned<LiteralKind>;

/// `key: value` in a `< … >` header.
#[derive(Clone, Debug, PartialEq)]
pub struct HeaderItem {
    /// The keyword.
    pub key: Spanned<String>,
    /// The value.
    pub value: HeaderValue,
    /// The whole item.
    pub span: Span,
}

/// Value of a header item.
#[derive(Clone, Debug, PartialEq)]
pub enum HeaderValue {
    /// A number or string.
    Literal(Literal),
    /// `["a" : 1, …]` or `["k": "v", …]`.
    Pairs(Vec<(Spanned<String>, Literal)>, Span),
}

/// A whole file.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    /// The header items, if a header was written.
    pub header: Option<Vec<HeaderItem>>,
    /// The main graph.
    pub graph: Graph,
    /// Functions after the graph.
    pub functions: Vec<Function>,
}

/// A type with its span.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeAst {
    /// The type.
    pub ty: Type,
    /// Where it was written.
    pub span: Span,
}

/// `type? name`.
#[derive(Clone, Debug, PartialEq)]
pub struct ValueInfo {
    /// The type, if written.
    pub ty: Option<TypeAst>,
    /// The name.
    pub name: Spanned<String>,
}

/// Tensor data after `=` (or in a tensor attribute).
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    /// `{1, 2, 3}`.
    Inline(Vec<Literal>, Span),
    /// `["location": "…", …]`.
    External(Vec<(String, String)>, Span),
    /// Values already decoded (from a binary model): the index into the values handed to
    /// [`lower_with`](crate::lower::lower_with).
    Decoded(usize, Span),
}

impl Data {
    /// Where the data was written.
    pub fn span(&self) -> Span {
        match self {
            Data::Inline(_, s) | Data::External(_, s) | Data::Decoded(_, s) => *s,
        }
    }
}

/// An entry of an input list or of the `< … >` list: a value info, with data for an
/// initializer.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// Type and name.
    pub info: ValueInfo,
    /// Data, for an initializer (or an input's default).
    pub data: Option<Data>,
    /// The whole entry.
    pub span: Span,
}

/// A graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    /// Its name.
    pub name: Spanned<String>,
    /// Inputs, some with default data.
    pub inputs: Vec<Entry>,
    /// Outputs.
    pub outputs: Vec<ValueInfo>,
    /// Initializers and value infos.
    pub inits: Vec<Entry>,
    /// Nodes.
    pub nodes: Vec<Node>,
    /// The whole graph.
    pub span: Span,
}

/// A node.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// `[label]`.
    pub label: Option<Spanned<String>>,
    /// Output names; `None` is an omitted output.
    pub outputs: Vec<Option<Spanned<String>>>,
    /// Domain prefix (`com.microsoft`), empty for the default.
    pub domain: String,
    /// Op type.
    pub op_type: Spanned<String>,
    /// `:overload`.
    pub overload: Option<String>,
    /// Attributes.
    pub attrs: Vec<Attr>,
    /// Input names; `None` is an omitted input.
    pub inputs: Vec<Option<Spanned<String>>>,
    /// The whole node.
    pub span: Span,
}

/// `name (: kind)? = value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Attr {
    /// The attribute's name.
    pub name: Spanned<String>,
    /// The kind annotation, if written.
    pub kind: Option<Spanned<String>>,
    /// The value.
    pub value: AttrValue,
    /// The whole attribute.
    pub span: Span,
}

/// A value or a list of values.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    /// One value.
    Single(Single),
    /// `[v, …]`.
    List(Vec<Single>, Span),
}

/// One attribute value.
#[derive(Clone, Debug, PartialEq)]
pub enum Single {
    /// A number or string.
    Literal(Literal),
    /// `float[2] name? {…}`.
    Tensor {
        /// Its type.
        ty: TypeAst,
        /// Its name, if written.
        name: Option<String>,
        /// Its data.
        data: Data,
        /// The whole constant.
        span: Span,
    },
    /// A type (`type_proto`).
    Type(TypeAst),
    /// A subgraph.
    Graph(Box<Graph>),
    /// `@name`.
    Ref(Spanned<String>),
}

impl Single {
    /// Where the value was written.
    pub fn span(&self) -> Span {
        match self {
            Single::Literal(l) => l.span,
            Single::Tensor { span, .. } => *span,
            Single::Type(t) => t.span,
            Single::Graph(g) => g.span,
            Single::Ref(r) => r.span,
        }
    }
}

/// A function definition.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    /// `< domain: …, opset_import: … >`.
    pub header: Option<Vec<HeaderItem>>,
    /// Its name.
    pub name: Spanned<String>,
    /// Attribute parameters without defaults.
    pub attr_params: Vec<Spanned<String>>,
    /// Attribute parameters with defaults.
    pub attr_defaults: Vec<Attr>,
    /// Formal inputs.
    pub inputs: Vec<ValueInfo>,
    /// Formal outputs.
    pub outputs: Vec<ValueInfo>,
    /// Value infos.
    pub value_infos: Vec<ValueInfo>,
    /// Body nodes.
    pub nodes: Vec<Node>,
    /// The whole function.
    pub span: Span,
}
